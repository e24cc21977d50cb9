"""Loaders for the public request traces in ../shared/traces (schemas in its README).

Every loader yields `TraceRequest`s sorted by arrival time, starting at t=0. Prompt content is
never in these traces; what matters for the engine is the prompt length, the output length and,
where the trace has them, prefix-block ids (mapped onto our 16-token block digests).
"""

from __future__ import annotations

import csv
import pathlib
from dataclasses import dataclass, field
from datetime import datetime


@dataclass(slots=True)
class TraceRequest:
    t: float  # arrival, seconds from the start of the trace
    prompt_len: int
    output_len: int
    block_digests: list[int] = field(default_factory=list)  # empty: no shareable prefix known


def load_azure(path: str | pathlib.Path) -> list[TraceRequest]:
    """Azure LLM inference trace 2023: CSV `TIMESTAMP,ContextTokens,GeneratedTokens`.

    The trace has no content, so requests share no prefix (empty digests)."""
    out: list[TraceRequest] = []
    with open(path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        if [h.strip() for h in header[:3]] != ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
            raise ValueError(f"{path}: not an Azure LLM trace (header {header!r})")
        t0 = None
        for row in reader:
            # 7 fractional digits; fromisoformat takes at most 6
            ts = datetime.fromisoformat(row[0][:26]).timestamp()
            t0 = ts if t0 is None else t0
            out.append(TraceRequest(ts - t0, max(1, int(row[1])), max(1, int(row[2]))))
    out.sort(key=lambda r: r.t)
    return out


MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_TIME_BUCKET_S = 3.0  # the conversation trace's timestamps fall in ~3 s buckets


def load_mooncake(path: str | pathlib.Path, block_size: int = 16) -> list[TraceRequest]:
    """Mooncake (FAST'25) JSONL: `{"timestamp": ms, "input_length", "output_length", "hash_ids"}`.

    Each hash id names a 512-token block; it is expanded into 512 / `block_size` sub-blocks whose
    digests chain on the previous one, so requests sharing leading ids share leading digests and
    a 16-token-block cache sees the same reuse. Timestamps are bucketed (~3 s in the conversation
    trace), so arrivals are spread evenly within their bucket."""
    import json

    import xxhash

    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not JSON: {exc}") from None
    if not rows or not {"timestamp", "input_length", "output_length", "hash_ids"} <= set(rows[0]):
        raise ValueError(f"{path}: not a Mooncake trace (need timestamp, input_length, output_length, hash_ids)")
    per_id = MOONCAKE_BLOCK_TOKENS // block_size
    by_bucket: dict[int, int] = {}
    for r in rows:
        by_bucket[r["timestamp"]] = by_bucket.get(r["timestamp"], 0) + 1
    seen_in_bucket: dict[int, int] = {}
    out = []
    for r in rows:
        ts = r["timestamp"]
        k = seen_in_bucket.get(ts, 0)
        seen_in_bucket[ts] = k + 1
        spread = MOONCAKE_TIME_BUCKET_S if len(by_bucket) > 1 else 0.0
        t = ts / 1000.0 + spread * k / by_bucket[ts]
        n_blocks = r["input_length"] // block_size
        digests: list[int] = []
        parent = 0
        for hid in r["hash_ids"]:
            for j in range(per_id):
                if len(digests) == n_blocks:
                    break
                parent = xxhash.xxh3_64_intdigest(f"{hid}:{j}".encode(), seed=parent)
                digests.append(parent)
        out.append(TraceRequest(t, max(1, r["input_length"]), max(1, r["output_length"]), digests))
    out.sort(key=lambda x: x.t)
    t0 = out[0].t
    for x in out:
        x.t -= t0
    return out


def load_trace(path: str | pathlib.Path) -> list[TraceRequest]:
    """Detect the format from the file: Azure CSV or Mooncake JSONL."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: no such trace file")
    with open(p) as f:
        head = f.readline()
    if head.startswith("TIMESTAMP,"):
        return load_azure(p)
    if head.lstrip().startswith("{") and "hash_ids" in head:
        return load_mooncake(p)
    raise ValueError(f"{path}: unknown trace format (expected an Azure LLM CSV or Mooncake JSONL)")
