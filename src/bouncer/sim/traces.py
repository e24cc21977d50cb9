"""Loaders for the public request traces (sources and schemas in data/traces/README.md).

Every loader yields `TraceRequest`s sorted by arrival time, starting at t=0. Prompt content is
never in these traces; what matters for the engine is the prompt length, the output length and,
where the trace has them, prefix-block ids (mapped onto our 16-token block digests).

Any trace file may be gzipped (`NAME.gz`): the repository carries its larger slices that way, and
a path to `NAME` finds `NAME.gz` when only that exists.
"""

from __future__ import annotations

import csv
import gzip
import io
import pathlib
from dataclasses import dataclass, field
from datetime import datetime


def trace_file(path: str | pathlib.Path) -> pathlib.Path:
    """`path`, or `path.gz` where only the gzipped file exists."""
    p = pathlib.Path(path)
    gz = p.with_name(p.name + ".gz")
    return gz if not p.exists() and gz.is_file() else p


def open_trace(path: str | pathlib.Path) -> io.TextIOBase:
    """A trace file opened as text, gunzipped on the fly if its name ends in .gz."""
    p = trace_file(path)
    if p.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(p), encoding="utf-8", newline="")
    return open(p, newline="", encoding="utf-8")


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
    with open_trace(path) as f:
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
    with open_trace(path) as f:
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


@dataclass(slots=True)
class AgentStep:
    prompt_len: int
    output_len: int
    block_ids: list[int]  # the session's own ids of `block_tokens`-token blocks, prefix order
    think_s: float  # pause after the previous step finished (tool use, the user), before this one
    # a step that waits for subagents (the results of the Task tools its previous step called):
    # it starts this long after the last of them ended, rather than `think_s` after that step
    after_subagents_s: float | None = None


@dataclass(slots=True)
class Subagent:
    """A child agent (Claude Code's Task tool): its own steps, closed-loop, from `offset_s` after
    the end of its parent's step `after_step` (-1: from the start of the parent's session)."""
    after_step: int
    offset_s: float
    waited: bool  # the parent's next step waits for it; `async_launched` ones are not waited for
    session: AgentSession


@dataclass(slots=True)
class AgentSession:
    name: str
    block_tokens: int
    steps: list[AgentStep]
    subagents: list[Subagent] = field(default_factory=list)

    def all_steps(self) -> int:
        """Its steps and its subagents', nested ones included."""
        return len(self.steps) + sum(s.session.all_steps() for s in self.subagents)


def load_weka(path: str | pathlib.Path) -> list[AgentSession]:
    """WEKA's Claude Code traces (kv-cache-tester): a folder of one JSON per session,
    `{id, block_size, hash_id_scope: "local", requests: [{t, type, in, out, hash_ids, think_time}]}`,
    where an entry of `type: "subagent"` is a child session with its own `requests`
    (`_parse_session`). Hash ids are local to a session, its subagents included (siblings share
    their system prompt's), so replays must keep sessions apart (`SessionDigests`). Sessions are
    replayed closed-loop: each step starts its think time after the previous one finished."""
    import json

    folder = pathlib.Path(path)
    files = sorted([*folder.glob("*.json"), *folder.glob("*.json.gz")]) if folder.is_dir() else [folder]
    sessions = []
    for f in files:
        try:
            with open_trace(f) as text:
                d = json.load(text)
            name = str(d.get("id", f.name.split(".")[0]))
            session = _parse_session(name, int(d["block_size"]), d["requests"])
        except (KeyError, TypeError, ValueError, OSError) as exc:  # OSError: a bad gzip file
            raise ValueError(f"{f}: not a WEKA agent session trace ({exc!r})") from None
        if not session.steps:
            raise ValueError(f"{f}: a WEKA session with no requests of its own")
        sessions.append(session)
    if not sessions:
        raise ValueError(f"{path}: no session JSON files")
    return sessions


def _parse_session(name: str, block_tokens: int, entries: list[dict]) -> AgentSession:
    """One session's requests, in trace order. A subagent entry's `t` is when it ended (its
    `duration_ms` before that it started, right as the parent's step that called it ended) unless
    it was launched asynchronously (no duration: `t` is its start); its own requests are timed
    from its start. The parent's next step comes after the last subagent it waited for ended."""
    steps: list[AgentStep] = []
    subagents: list[Subagent] = []
    prev_end = 0.0  # trace time the latest step ended
    waited_ends: list[float] = []  # trace times the subagents launched since that step ended
    for r in entries:
        if r.get("type") == "subagent":
            waited = r.get("duration_ms") is not None
            start = float(r["t"]) - (float(r["duration_ms"]) / 1000.0 if waited else 0.0)
            child = _parse_session(f"{name}/{r.get('agent_id', len(subagents))}", block_tokens, r["requests"])
            subagents.append(Subagent(len(steps) - 1, max(0.0, start - prev_end), waited, child))
            if waited:
                waited_ends.append(float(r["t"]))
            continue
        t = float(r["t"])
        after = max(0.0, t - max(waited_ends)) if waited_ends else None
        steps.append(AgentStep(max(1, int(r["in"])), max(1, int(r["out"])), list(r["hash_ids"]),
                               float(r.get("think_time") or 0.0), after))
        waited_ends = []
        prev_end = t + float(r.get("api_time") or 0.0)
    return AgentSession(name, block_tokens, steps, subagents)


class SessionDigests:
    """Our 16-token chained digests for one replay of a session: each trace block id becomes
    block_tokens / block_size sub-blocks, keyed by the replay (`instance`) so that two replays of
    the same session share nothing. Consecutive steps extend the same prefix, so the chain computed
    for one step is reused by the next."""

    def __init__(self, instance: str, block_tokens: int, block_size: int = 16) -> None:
        import xxhash

        self._hash = xxhash.xxh3_64_intdigest
        self.instance = instance
        self.per_id = max(1, block_tokens // block_size)
        self.block_size = block_size
        self._ids: list[int] = []
        self._digests: list[int] = []

    def of(self, step: AgentStep, max_prompt: int) -> list[int]:
        ids = step.block_ids
        common = 0
        for a, b in zip(ids, self._ids, strict=False):
            if a != b:
                break
            common += 1
        digests = self._digests[:common * self.per_id]
        parent = digests[-1] if digests else 0
        for hid in ids[common:]:
            for j in range(self.per_id):
                parent = self._hash(f"{self.instance}:{hid}:{j}".encode(), seed=parent)
                digests.append(parent)
        self._ids, self._digests = ids, digests
        return digests[:min(step.prompt_len, max_prompt) // self.block_size]


def load_trace(path: str | pathlib.Path) -> list[TraceRequest]:
    """Detect the format from the file: Azure CSV or Mooncake JSONL (either may be gzipped)."""
    p = trace_file(path)
    if p.is_dir():
        raise ValueError(f"{path}: a folder; of trace folders only ServeGen's (chunk-<client>-trace.csv) is "
                         f"known, and it replaces a scenario's tenants")
    if not p.is_file():
        raise ValueError(f"{path}: no such trace file")
    with open_trace(p) as f:
        head = f.readline()
    if head.startswith("TIMESTAMP,"):
        return load_azure(p)
    if head.lstrip().startswith("{") and "hash_ids" in head:
        return load_mooncake(p)
    raise ValueError(f"{path}: unknown trace format (expected an Azure LLM CSV or Mooncake JSONL)")
