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
