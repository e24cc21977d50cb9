"""vLLM's KV-event wire format: the engine model publishes it, the gateway reads it.

vLLM (`--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq"}'`) sends each
batch as a ZMQ multipart message `(topic, seq, payload)`: `seq` is an 8-byte big-endian counter
and `payload` a msgpack `[ts, events, data_parallel_rank?]`. Each event is a msgspec tagged
struct: a map with a `type` field in vLLM 0.32 (vllm/distributed/kv_events.py), an array with the
tag first in older releases. Decoding accepts both and ignores fields it does not use, so newer
engines with extra fields still decode. Blocks in every tier are kept (the GPU, or "CPU" with
vLLM's KV offloading): a prefix held anywhere is reused without recomputation.
"""

from __future__ import annotations

from typing import Any

import msgspec

from bouncer.core.fleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class WireError(ValueError):
    """A message that is not a KV-event batch."""


# -- encoding (the engine model's publisher) ------------------------------------------------------
class _Stored(msgspec.Struct, tag="BlockStored", omit_defaults=True, gc=False):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None  # per block, what else keys it: a prompt's first block, its cache salt


class _Removed(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, gc=False):
    block_hashes: list[Any]
    medium: str | None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, gc=False):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[KVEvent]) -> bytes:
    out: list[_Stored | _Removed | _Cleared] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            extra = [[ev.salt], *[None] * (len(ev.block_hashes) - 1)] if ev.salt else None
            out.append(_Stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, None, ev.medium,
                               None, extra))
        elif isinstance(ev, BlockRemoved):
            out.append(_Removed(ev.block_hashes, ev.medium))
        else:
            out.append(_Cleared())
    return _encoder.encode(_Batch(ts, out))


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


# -- decoding (the gateway's subscriber) ------------------------------------------------------------
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys")


def _salt(f: dict[str, Any]) -> str | None:
    """The cache salt of a prompt's first block: in vLLM's extra keys of that block (untagged, in
    order: the LoRA name where there is one, multimodal (id, offset) pairs, the salt), the string
    that is not the LoRA name."""
    extra = f.get("extra_keys")
    if f.get("parent_block_hash") is not None or not extra or not extra[0]:
        return None
    keys = list(extra[0])
    if f.get("lora_name") is not None and keys and keys[0] == f["lora_name"]:
        keys = keys[1:]
    return next((k for k in keys if isinstance(k, str)), None)
_REMOVED_FIELDS = ("block_hashes", "medium")


def _fields(raw: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    return dict(zip(names, raw[1:], strict=False))  # array form: the tag, then fields in order


def _event(raw: Any) -> KVEvent | None:
    if isinstance(raw, dict):
        tag = raw.get("type")
    elif isinstance(raw, list) and raw:
        tag = raw[0]
    else:
        raise WireError(f"not a KV event: {raw!r:.80}")
    if tag == "BlockStored":
        f = _fields(raw, _STORED_FIELDS)
        if f.get("lora_id") is not None:
            return None  # an adapter's blocks: not what a base-model prompt reuses
        return BlockStored(list(f["block_hashes"]), f.get("parent_block_hash"), list(f.get("token_ids") or []),
                           int(f["block_size"]), f.get("medium") or "GPU", _salt(f))
    if tag == "BlockRemoved":
        f = _fields(raw, _REMOVED_FIELDS)
        return BlockRemoved(list(f["block_hashes"]), f.get("medium") or "GPU")
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    return None  # an event kind this gateway does not know: skip it, keep the rest


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """(timestamp, events) of one batch; raises WireError for anything else."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise WireError("a KV-event batch is [ts, events, ...]")
    try:
        events = [e for e in map(_event, raw[1]) if e is not None]
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed KV event: {exc}") from None
    return float(raw[0]), events


def decode_seq(seq: bytes) -> int:
    if len(seq) != 8:
        raise WireError("sequence number must be 8 bytes")
    return int.from_bytes(seq, "big", signed=True)
