"""Workloads for the fleet simulator: tenants drawing requests from real traces at a load factor.

Load 1.0 means exactly the fleet's *capacity* for the scenario's request mix: the sustained
completion rate of the same fleet, with no admission control, under a saturating closed loop of
that mix (`measure_capacity`). A trace is replayed with its own inter-arrival pattern, its time
axis scaled so that the tenant's mean rate is its share of `load x capacity`; bursts add
further time-shifted copies of the same trace for their window.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bouncer.sim.fleet import FleetConfig, FleetSim, SimRequest
from bouncer.sim.traces import TraceRequest


@dataclass(frozen=True)
class Burst:
    start_s: float
    end_s: float
    multiplier: float  # the tenant's rate during the window, as a multiple of its base rate


@dataclass(frozen=True)
class TenantSpec:
    name: str
    priority: int
    share: float  # of the offered load at load factor 1 (shares of a scenario add up to 1)
    trace: str  # key into the scenario's traces
    weight: float = 1.0
    ttft_slo: float | None = None
    tpot_slo: float | None = None
    max_tokens: int = 2048
    min_prompt: int | None = None  # e.g. a free tier sending max-length prompts
    timeout_s: float = 60.0
    max_retries: int = 2  # openai-python's default
    bursts: tuple[Burst, ...] = ()


def _scaled_arrivals(trace: Sequence[TraceRequest], rate: float, start: float, end: float,
                     offset: int) -> list[tuple[float, TraceRequest]]:
    """The trace's own arrival pattern, time-scaled to `rate` and cycled to cover [start, end)."""
    if rate <= 0 or not trace:
        return []
    span = trace[-1].t - trace[0].t
    native = (len(trace) - 1) / span if span > 0 else rate
    scale = rate / native  # trace seconds per simulated second
    out = []
    n = len(trace)
    i = offset % n
    base = start - (trace[i].t - trace[0].t) / scale
    cycle = (span + span / max(1, n - 1)) / scale  # one pass of the trace, in simulated seconds
    k = 0
    while True:
        t = base + k * cycle + (trace[i].t - trace[0].t) / scale
        if t >= end:
            return out
        if t >= start:
            out.append((t, trace[i]))
        i += 1
        if i == n:
            i = 0
            k += 1


def make_requests(tenants: list[TenantSpec], traces: dict[str, Sequence[TraceRequest]], total_rate: float,
                  duration_s: float, seed: int) -> list[SimRequest]:
    rng = random.Random(seed)
    out: list[SimRequest] = []
    for spec in tenants:
        trace = traces[spec.trace]
        rate = spec.share * total_rate
        arrivals = _scaled_arrivals(trace, rate, 0.0, duration_s, rng.randrange(len(trace)))
        for b in spec.bursts:
            extra = b.multiplier - 1
            copies = math.floor(extra)
            for _ in range(copies):
                arrivals += _scaled_arrivals(trace, rate, b.start_s, min(b.end_s, duration_s),
                                             rng.randrange(len(trace)))
            if extra - copies > 0:
                arrivals += _scaled_arrivals(trace, rate * (extra - copies), b.start_s, min(b.end_s, duration_s),
                                             rng.randrange(len(trace)))
        for t, tr in arrivals:
            out.append(_request(spec, tr, f"{spec.name}-{len(out)}", t))
    out.sort(key=lambda r: r.arrival)
    return out


def steady_requests(tenants: list[TenantSpec], traces: dict[str, Sequence[TraceRequest]], total_rate: float,
                    duration_s: float, seed: int, shape: Callable[[float], float] | None = None,
                    peak: float = 1.0) -> list[SimRequest]:
    """A steady load: Poisson arrivals at `total_rate`, each request drawn at random from its
    tenant's trace (tenants by share; bursts left out), where `make_requests` keeps each trace's
    own arrival pattern. `shape(t)`: a rate that changes, `total_rate x shape(t)`, at most
    `peak` x it (drawn at the peak rate, each kept with probability shape(t) / peak)."""
    rng = random.Random(seed)
    cum = list(itertools.accumulate(t.share for t in tenants))
    out: list[SimRequest] = []
    top = total_rate * (peak if shape else 1.0)
    t = rng.expovariate(top) if top > 0 else duration_s
    while t < duration_s:
        keep = shape is None or rng.random() * peak < shape(t)
        spec = tenants[min(bisect.bisect(cum, rng.random() * cum[-1]), len(tenants) - 1)]
        trace = traces[spec.trace]
        request = trace[rng.randrange(len(trace))]
        if keep:
            out.append(_request(spec, request, f"{spec.name}-{len(out)}", t))
        t += rng.expovariate(top)
    return out


def _request(spec: TenantSpec, tr: TraceRequest, rid: str, arrival: float) -> SimRequest:
    prompt = max(tr.prompt_len, spec.min_prompt or 0)
    return SimRequest(
        rid=rid, tenant=spec.name, priority=spec.priority, arrival=arrival,
        prompt_len=prompt, output_len=max(1, min(tr.output_len, spec.max_tokens)),
        max_tokens=spec.max_tokens,
        block_digests=tr.block_digests if prompt == tr.prompt_len else [],
        ttft_slo=spec.ttft_slo, tpot_slo=spec.tpot_slo, timeout_s=spec.timeout_s,
        max_retries=spec.max_retries)


def measure_capacity(cfg: FleetConfig, policy_factory, tenants: list[TenantSpec],
                     traces: dict[str, Sequence[TraceRequest]], seed: int, warmup_s: float = 60.0,
                     measure_s: float = 240.0) -> float:
    """Completions per second of the fleet under a saturating closed loop of the scenario's mix,
    with no admission control: each client sends, waits for the answer, sends again. The number
    of clients is twice what the fleet's KV holds at once, so engines always have a queue."""
    rng = random.Random(seed)
    cum = []
    acc = 0.0
    for t in tenants:
        acc += t.share
        cum.append(acc)

    def draw() -> tuple[TenantSpec, TraceRequest]:
        spec = tenants[min(bisect.bisect(cum, rng.random() * acc), len(tenants) - 1)]
        return spec, traces[spec.trace][rng.randrange(len(traces[spec.trace]))]

    sample = [draw() for _ in range(2000)]
    mean_tokens = sum(max(tr.prompt_len, s.min_prompt or 0) + min(tr.output_len, s.max_tokens)
                      for s, tr in sample) / len(sample)
    engines = cfg.replicas + cfg.decode_replicas
    kv_tokens = (cfg.kv_blocks or cfg.profile.num_blocks) * cfg.profile.block_size * engines
    clients = max(8, int(2 * kv_tokens / mean_tokens))

    def make_request(rid: str, now: float) -> SimRequest:
        spec, tr = draw()
        prompt = max(tr.prompt_len, spec.min_prompt or 0)
        return SimRequest(rid=rid, tenant=spec.name, priority=spec.priority, arrival=now, prompt_len=prompt,
                          output_len=max(1, min(tr.output_len, spec.max_tokens)), max_tokens=spec.max_tokens,
                          block_digests=tr.block_digests if prompt == tr.prompt_len else [],
                          ttft_slo=None, tpot_slo=None, timeout_s=1e9, max_retries=0)

    policy = policy_factory()
    sim = FleetSim(cfg, policy, policy.replica_names)
    return sim.run_closed_loop(make_request, clients, warmup_s, measure_s)
