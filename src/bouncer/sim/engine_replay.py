"""Open-loop replay of a trace against one engine model, in virtual time.

This measures the engine model alone (no gateway): what one replica does with a stream of
requests, and how fast the model simulates it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from bouncer.sim.engine import EngineModel, EngineRequest, RequestTooLong
from bouncer.sim.traces import TraceRequest


@dataclass(slots=True)
class ReplaySummary:
    requests: int
    completed: int
    refused: int
    sim_seconds: float
    wall_seconds: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    e2e_p99: float
    max_waiting: int
    max_kv_usage: float
    preemptions: int
    steps: int
    generation_tokens: int

    @property
    def speedup(self) -> float:
        return self.sim_seconds / self.wall_seconds if self.wall_seconds > 0 else math.inf


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def replay(engine: EngineModel, trace: list[TraceRequest], duration: float | None = None) -> ReplaySummary:
    """Feed `trace` (arrivals up to `duration` seconds) into `engine` and run it dry."""
    if duration is not None:
        trace = [r for r in trace if r.t < duration]
    wall0 = time.perf_counter()
    now = 0.0
    i = 0
    n = len(trace)
    refused = 0
    ttft: list[float] = []
    tpot: list[float] = []
    e2e: list[float] = []
    max_waiting = 0
    max_kv = 0.0
    while i < n or engine.has_work:
        while i < n and trace[i].t <= now:
            tr = trace[i]
            out = min(tr.output_len, engine.max_model_len - tr.prompt_len)
            try:
                engine.add_request(EngineRequest(str(i), tr.prompt_len, max(1, out), tr.block_digests, tr.t))
            except RequestTooLong:
                refused += 1
            i += 1
        next_arrival = trace[i].t if i < n else math.inf
        res = engine.step(now, next_arrival)
        if res is None:
            now = next_arrival
            continue
        now = res.end
        max_waiting = max(max_waiting, engine.num_waiting)
        max_kv = max(max_kv, engine.kv_usage)
        for r in res.finished:
            ttft.append(r.first_token_at - r.arrival)
            e2e.append(r.finished_at - r.arrival)
            if r.num_output > 1:
                tpot.append((r.finished_at - r.first_token_at) / (r.num_output - 1))
    wall = time.perf_counter() - wall0
    return ReplaySummary(len(trace), len(e2e), refused, now, wall, _pct(ttft, 0.5), _pct(ttft, 0.99),
                         _pct(tpot, 0.5), _pct(e2e, 0.99), max_waiting, max_kv,
                         engine.counters.num_preemptions, engine.counters.steps,
                         engine.counters.generation_tokens)
