"""From an OpenAI request body to what the core needs: sizes, identity, deadlines.

Prompt tokens come from the model's own `tokenizer.json` when one is configured. Without one,
Bouncer falls back to a stated estimate: one token per 4 UTF-8 bytes (the usual rule of thumb
for English BPE vocabularies), with pseudo-token ids made from those 4-byte groups so that equal
prefixes still hash to equal blocks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from array import array
from typing import Any

import orjson
import xxhash

from bouncer.core.fleet.blocks import chain_block_hashes
from bouncer.core.requests import RequestInfo
from bouncer.gateway.request_params import check_params
from bouncer.openai_wire import ApiError
from bouncer.tokenizer import (
    PromptTokenizer,
    content_text,
    media_items,
    render_chat,
    tool_calls_text,
)

BYTES_PER_TOKEN_ESTIMATE = 4
TOKEN_ID_LIMIT = 2**32  # token ids are hashed as unsigned 32-bit integers (bouncer.core.fleet.blocks)


def key_digest_from_headers(headers) -> str | None:
    """SHA-256 of the presented API key (`Authorization: Bearer` or `api-key`). Not cached: a
    cache would keep recently presented keys in memory in clear, and hashing one costs about a
    microsecond."""
    auth = headers.get("Authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get("api-key", "").strip()
    # bytes a header carried that are not UTF-8 come as surrogates: hash them as they came (no
    # tenant has such a key, so it is a 401, not an error)
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest() if key else None


def fairness_id_from_headers(headers) -> str | None:
    """llm-d's fairness id (or its older name): a tenant's name for a request, where the config
    trusts a gateway in front to set it (`access.trust_fairness_id`)."""
    return headers.get("x-llm-d-inference-fairness-id") or headers.get("x-gateway-inference-fairness-id") or None


def _estimate_ids(text: str) -> list[int]:
    raw = text.encode()
    return [int.from_bytes(raw[i:i + BYTES_PER_TOKEN_ESTIMATE], "little")
            for i in range(0, len(raw), BYTES_PER_TOKEN_ESTIMATE)]


def _prompt(kind: str, body: dict[str, Any], vocab_size: int | None) -> list | str:
    """The prompt, checked: a chat's messages, a completion's text or token ids. Every way a
    prompt can be malformed is found here, before anything is tokenized."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of message objects", param="messages",
                           code="invalid_parameter")
        for m in messages:
            try:
                content_text(m.get("content"))
                tool_calls_text(m.get("tool_calls"))
            except TypeError as exc:
                raise ApiError(400, f"invalid messages: {exc}", param="messages",
                               code="invalid_parameter") from None
        return messages
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        limit = vocab_size if vocab_size is not None else TOKEN_ID_LIMIT
        if not all(0 <= t < limit for t in prompt):
            raise ApiError(400, f"prompt token ids must be from 0 to {limit - 1}", param="prompt",
                           code="invalid_parameter")
        return prompt
    raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)",
                   param="prompt", code="invalid_parameter")


def prompt_token_ids(kind: str, body: dict[str, Any], tokenizer: PromptTokenizer | None) -> list[int] | array:
    """The prompt's token ids (the model's tokenizer, or the stated estimate): a chat's over all
    the engine reads of it, its tools and tool calls included."""
    prompt = _prompt(kind, body, tokenizer.vocab_size if tokenizer is not None else None)
    if kind == "chat":
        tools = body.get("tools")
        return tokenizer.encode_chat(prompt, tools) if tokenizer is not None else \
            _estimate_ids(render_chat(prompt, tools))
    if isinstance(prompt, str):
        return tokenizer.encode(prompt) if tokenizer is not None else _estimate_ids(prompt)
    return prompt


def min_prompt_tokens(kind: str, prompt: list | str, tokenizer: PromptTokenizer | None, tools: list | None = None,
                      media_tokens: int = 0) -> int:
    """At most the prompt's token count, from its text's bytes alone (0 where no bound holds)."""
    if not isinstance(prompt, str) and kind != "chat":
        return len(prompt)  # token ids: exactly
    media = media_items(prompt) * media_tokens if kind == "chat" else 0
    per_token = BYTES_PER_TOKEN_ESTIMATE if tokenizer is None else tokenizer.max_token_bytes
    if not per_token:
        return media
    text = prompt if isinstance(prompt, str) else render_chat(prompt, tools)
    return len(text.encode("utf-8", "surrogatepass")) // per_token + media


def _header_ms(headers, name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ApiError(400, f"header {name} must be a positive, finite number of milliseconds", param=name,
                       code="invalid_parameter")
    return value / 1000.0


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")


def _header_duration(headers, name: str) -> float | None:
    """A Go duration (`1500ms`, `30s`, `1m30s`), as llm-d's headers carry them, in seconds."""
    raw = headers.get(name)
    if raw is None:
        return None
    text = raw.strip()
    parts = _GO_DURATION.findall(text)
    value = sum(float(n) * _GO_UNITS[u] for n, u in parts)
    if not parts or "".join(n + u for n, u in parts) != text or not math.isfinite(value) or value <= 0:
        raise ApiError(400, f"header {name} must be a positive duration such as 1500ms or 30s", param=name,
                       code="invalid_parameter")
    return value


def _tightest(*values: float | None) -> float | None:
    """Of a client's own limits (Bouncer's header and llm-d's for the same thing), the tighter."""
    given = [v for v in values if v is not None]
    return min(given) if given else None


def _retry_count(headers) -> int | None:
    """The OpenAI SDKs' x-stainless-retry-count: 0 on a first attempt, n on the n-th retry. A
    client library's bookkeeping, not the caller's input: a malformed one is ignored."""
    raw = headers.get("x-stainless-retry-count")
    try:
        count = int(raw) if raw is not None else None
    except ValueError:
        return None
    return count if count is not None and count >= 0 else None


def request_head(request_id: str, kind: str, body: dict[str, Any], headers,
                 tokenizer: PromptTokenizer | None, media_tokens: int = 0) -> RequestInfo:
    """All of a request but its prompt's tokens: checked whole (raises ApiError for any bad
    field), not tokenized, for the core's precheck. `with_prompt` completes it. `media_tokens`:
    what each image (audio clip, video) of a chat counts (`ModelConfig.media_tokens`)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required", param="model", code="invalid_parameter")
    check_params(kind, body)
    prompt = _prompt(kind, body, tokenizer.vocab_size if tokenizer is not None else None)
    # the parameters' types are checked: integers, strings, or None
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    stop = body.get("stop")  # checked: a string or a list of strings
    num_stop = 0 if stop is None else 1 if isinstance(stop, str) else len(stop)
    user = body.get("user") or None
    retry_count = _retry_count(headers)
    return RequestInfo(
        request_id=request_id, key_digest=key_digest_from_headers(headers), model=model,
        prompt_tokens=0, max_tokens=max_tokens,
        n=body.get("n") or 1, best_of=body.get("best_of"), num_stop=num_stop,
        # Bouncer's own headers and llm-d's: each only tightens what the tenant's config allows
        ttl_s=_tightest(_header_ms(headers, "x-bouncer-ttl-ms"), _header_duration(headers, "x-llm-d-inference-ttl")),
        ttft_slo_s=_tightest(_header_ms(headers, "x-bouncer-ttft-ms"), _header_ms(headers, "x-llm-d-slo-ttft-ms")),
        tpot_slo_s=_tightest(_header_ms(headers, "x-bouncer-tpot-ms"), _header_ms(headers, "x-llm-d-slo-tpot-ms")),
        fairness_id=fairness_id_from_headers(headers),
        objective=headers.get("x-llm-d-inference-objective") or headers.get("x-gateway-inference-objective") or None,
        session_id=headers.get("x-session-id") or None,
        parent_session_id=headers.get("x-parent-session-id") or None,
        user=user, retry_count=retry_count,
        min_prompt_tokens=min_prompt_tokens(kind, prompt, tokenizer, body.get("tools"), media_tokens),
        # only a client that numbers its attempts can be known again when it retries; the prompt
        # as sent (a retry sends it again), hashed before it is tokenized, so a retry of one the
        # precheck refused is known too
        prompt_digest=xxhash.xxh3_64_intdigest(orjson.dumps(prompt)) if retry_count is not None else None)


def with_prompt(head: RequestInfo, kind: str, body: dict[str, Any], tokenizer: PromptTokenizer | None,
                block_size: int, media_tokens: int = 0) -> RequestInfo:
    """`head` with its prompt's token count and block digests (the body was checked by
    `request_head`: this tokenizes and hashes, and cannot fail). A chat's images (audio, video)
    count `media_tokens` each: the engine's own count depends on the model and the media, and
    its usage settles what the request used."""
    if kind == "chat" and tokenizer is not None:  # a conversation's next step: only what is new costs
        ids, digests = tokenizer.encode_chat_blocks(body["messages"], block_size, body.get("tools"))
    else:
        ids = prompt_token_ids(kind, body, tokenizer)
        digests = chain_block_hashes(ids, block_size)
    media = media_items(body["messages"]) * media_tokens if kind == "chat" else 0
    return dataclasses.replace(head, prompt_tokens=len(ids) + media, block_digests=digests)
