"""Admission and autoscaling together, in the simulator: which signal an autoscaler should read,
and what admission adds while replicas start.

A fleet whose replicas an HPA-like provisioner (`bouncer.sim.provisioner`) adds and removes,
each ready `startup_s` (5 minutes) after it is asked for, driven by one of three signals, with
and without Bouncer's admission in front (`none`: every request queues at an engine, as vLLM
does):

- `waiting`: the engines' waiting requests, summed (KEDA on `vllm:num_requests_waiting`),
  5 per replica;
- `kv`: the engines' mean KV cache usage, 80% per replica (a utilisation target);
- `demand`: Bouncer's demand signal, averaged over the start-up time (`avg_over_time(...[5m])`:
  demand that lasts less than a replica takes to start cannot be served by a new one), 0.8 per
  replica. Behind `none` it is computed from the same arrivals by a gateway that admits
  everything (the signal without the admission);
- `demand-protected`: the same over the bands >= 0 alone.

Scenarios (requests of the Azure conversation trace, Poisson arrivals; a replica's capacity as
`bench demand` measures it):
- `burst`: 1.6 replicas' worth, the standard and batch bands 10x for 30 s at 15 minutes (the
  protected band steady); 40 minutes;
- `growth`: from 0.8 replicas' worth, growing 5% a day for 30 days compressed into an hour;
- `hog`: 1.2 replicas' worth, and from 10 to 30 minutes a sheddable tenant sending 3 replicas'
  worth more; 40 minutes;
- `swap`: 1.2 replicas' worth on 2, and at 15 minutes a new model version rolled out one replica
  at a time (each drained, reloaded for the start-up time, back: `RollingSwap`); 50 minutes.

Tenants: `interactive` (band 10, TTFT 1 s, TPOT 0.1 s: the protected band), `standard` (band 0,
TTFT 5 s) and `batch` (band -1, TTFT 30 s, sheddable). Reported: goodput (completed within SLO,
per second), each band's attainment (within SLO over offered) over the run and in its worst 5
minutes, replica-minutes paid (starting ones included), and after the burst, how long until the
fleet was back to its size before it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import statistics
import time
from collections.abc import Callable

from bouncer.bench.goodput import fleet_capacity, fleet_config, make_policy, within_slo
from bouncer.core.fleet.demand import Demand
from bouncer.core.learning.step_time import StepTimeModel
from bouncer.sim.fleet import FleetSim, SimRequest
from bouncer.sim.policies import SIM_MODEL
from bouncer.sim.profiles import DEFAULT_PROFILE
from bouncer.sim.provisioner import Averaged, Provisioner, Signal
from bouncer.sim.scenarios import AZURE_CONV, get_scenario
from bouncer.sim.traces import load_trace
from bouncer.sim.workloads import TenantSpec, steady_requests

SCENARIOS = ("burst", "growth", "hog", "swap")
SIGNALS = ("waiting", "kv", "demand", "demand-protected")
ADMISSIONS = ("none", "bouncer")
STEP_S = 5.0  # how often the provisioner looks (it decides every interval_s)
WORST_WINDOW_S = 300.0
HISTORY = ("t", "signal", "desired", "ready", "paid")
WAITING_PER_REPLICA = 5.0
KV_TARGET = 0.8
DEMAND_TARGET = 0.8

TENANTS = [
    TenantSpec("interactive", priority=10, share=0.3, trace="conv", ttft_slo=1.0, tpot_slo=0.1, max_tokens=1024),
    TenantSpec("standard", priority=0, share=0.4, trace="conv", ttft_slo=5.0, max_tokens=1024),
    TenantSpec("batch", priority=-1, share=0.3, trace="conv", ttft_slo=30.0, max_tokens=1024, timeout_s=120.0),
]
HOG = TenantSpec("hog", priority=-1, share=1.0, trace="conv", ttft_slo=30.0, max_tokens=1024, timeout_s=120.0)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    duration_s: float
    start_replicas: int
    base: float  # replicas' worth of the main tenants
    shape: Callable[[float], float]  # their rate over time, times `base`
    peak: float
    hog: tuple[float, float, float] | None = None  # (from, to, replicas' worth)
    burst: tuple[float, float] | None = None  # (from, to): the protected band stays steady through it
    swap_at: float | None = None  # a new model version rolled out from then (`RollingSwap`)


def workload(name: str) -> Workload:
    if name == "burst":
        return Workload(name, 2400.0, 2, 1.6, lambda t: 10.0 if 900 <= t < 930 else 1.0, 10.0, burst=(900.0, 930.0))
    if name == "growth":
        days, duration = 30, 3600.0
        return Workload(name, duration, 1, 0.8, lambda t: 1.05 ** (days * t / duration), 1.05 ** days)
    if name == "hog":
        return Workload(name, 2400.0, 2, 1.2, lambda t: 1.0, 1.0, hog=(600.0, 1800.0, 3.0))
    if name == "swap":
        return Workload(name, 3000.0, 2, 1.2, lambda t: 1.0, 1.0, swap_at=900.0)
    raise ValueError(f"unknown autoscaling scenario {name!r}; known: {', '.join(SCENARIOS)}")


class RollingSwap:
    """A new model version rolled out as a GPU-bound Deployment does it (maxSurge 0,
    maxUnavailable 1: no spare GPU to start the new one beside the old): from `at`, one replica
    at a time is taken out (it finishes what it holds, gets nothing new: drained), reloads for
    `startup_s`, and comes back as a new replica; then the next. Replicas the autoscaler adds
    meanwhile start with the new version. Its reloading replica is paid (`replica_seconds`)."""

    def __init__(self, at: float, startup_s: float) -> None:
        self.at, self.startup_s = at, startup_s
        self.old: list[str] | None = None  # what is left to replace
        self.current: str | None = None  # being drained, then reloaded
        self.ready_at: float | None = None
        self.done_at: float | None = None
        self.replica_seconds = 0.0
        self._last: float | None = None
        self._n = 0

    def step(self, fleet: FleetSim, now: float) -> None:
        if self._last is not None and self.ready_at is not None:
            self.replica_seconds += now - self._last  # reloading: its GPU held, serving nothing
        self._last = now
        if now < self.at or self.done_at is not None:
            return
        if self.old is None:
            self.old = list(fleet.serving())
        if self.current is None:
            self.old = [n for n in self.old if n in fleet.serving()]  # (the autoscaler may have taken some)
            if not self.old:
                self.done_at = now
                return
            self.current = self.old.pop(0)
            fleet.retire(self.current, now)
        if self.ready_at is None and self.current not in fleet.engines:  # drained
            self.ready_at = now + self.startup_s
        if self.ready_at is not None and now >= self.ready_at:
            fleet.add_engine(f"v2-{self._n}", now)
            self._n += 1
            self.current = self.ready_at = None


class _Observed:
    """A gateway that admits everything but keeps Bouncer's demand signal: the `none` policy,
    with every first attempt, prompt and answer counted as the core counts them."""

    def __init__(self, inner, demand: Demand) -> None:
        self._inner, self.demand = inner, demand

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def offer(self, req: SimRequest, now: float):
        if req.attempt == 1:
            self.demand.arrived_first(req.tenant, req.priority >= 0, now)
            self.demand.sized(req.tenant, req.priority >= 0, req.prompt_len, now)
        return self._inner.offer(req, now)

    def finished(self, attempt_id, now, completed, completion_tokens):
        if completed:
            tenant = attempt_id.rsplit("-", 1)[0]
            self.demand.completed(tenant, _BANDS.get(tenant, 0) >= 0, completion_tokens, now)
        return self._inner.finished(attempt_id, now, completed, completion_tokens)


_BANDS = {t.name: t.priority for t in [*TENANTS, HOG]}


def _signal(kind: str, policy, profile, startup_s: float) -> Signal:
    if kind == "waiting":
        return Signal(kind, lambda fleet, now: float(sum(fleet.engines[n].num_waiting for n in fleet.serving())),
                      WAITING_PER_REPLICA)
    if kind == "kv":
        def kv(fleet: FleetSim, now: float) -> float:
            serving = fleet.serving()
            return statistics.fmean(fleet.engines[n].kv_usage for n in serving) if serving else 1.0
        return Signal(kind, kv, KV_TARGET, kind="mean")
    protected = kind == "demand-protected"
    if isinstance(policy, _Observed):
        step = StepTimeModel(profile.a, profile.b, profile.c, profile.max_num_batched_tokens, profile.d)
        kv_tokens = profile.num_blocks * profile.block_size

        def read(now: float) -> float:
            return policy.demand.estimate(now, step, profile.max_num_seqs, kv_tokens, None, 256, protected).replicas
    else:
        view = policy.core.view
        scope = "protected" if protected else "all"

        def read(now: float) -> float:
            return view.demand(SIM_MODEL, now)[scope].replicas
    return Signal(kind, Averaged(startup_s, read), DEMAND_TARGET)


def run(scenario: str | Workload, admission: str, signal: str, startup_s: float = 300.0, seed: int = 0) -> dict:
    w = workload(scenario) if isinstance(scenario, str) else scenario
    base = get_scenario("surge", w.duration_s)  # (its capacity on one replica is what `bench demand` uses)
    traces = {"conv": load_trace(AZURE_CONV)}
    one = dataclasses.replace(base, tenants=TENANTS, name="autoscaling")
    capacity = fleet_capacity(one, traces, 1, DEFAULT_PROFILE, seed, None)
    # a burst is the other bands'; growth is everyone's
    top, rest = TENANTS[:1], TENANTS[1:]
    share = top[0].share
    steady = w.burst is not None
    requests = steady_requests(top, traces, share * w.base * capacity, w.duration_s, seed,
                               None if steady else w.shape, 1.0 if steady else w.peak)
    requests += steady_requests(rest, traces, (1 - share) * w.base * capacity, w.duration_s, seed + 2, w.shape,
                                w.peak)
    requests.sort(key=lambda r: r.arrival)
    if w.hog is not None:
        start, end, worth = w.hog
        hog = steady_requests([HOG], traces, worth * capacity, w.duration_s, seed + 1,
                              lambda t: 1.0 if start <= t < end else 0.0, 1.0)
        requests = sorted(requests + hog, key=lambda r: r.arrival)
    cfg = fleet_config(admission, w.start_replicas, DEFAULT_PROFILE, seed, one)
    scenario_spec = dataclasses.replace(one, tenants=[*TENANTS, HOG])
    policy = make_policy(admission, scenario_spec, cfg)
    if admission == "none":
        policy = _Observed(policy, Demand(30.0))
    fleet = FleetSim(cfg, policy, policy.replica_names)
    provisioner = Provisioner(_signal(signal, policy, cfg.profile, startup_s), min_replicas=1, max_replicas=16,
                              startup_s=startup_s)
    swap = RollingSwap(w.swap_at, startup_s) if w.swap_at is not None else None

    def step(now: float) -> None:
        provisioner.step(fleet, now)
        if swap is not None:
            swap.step(fleet, now)
    fleet.record(STEP_S, step)
    started = time.perf_counter()
    result = fleet.run(requests)
    out = summarize(w, admission, signal, startup_s, capacity, requests, provisioner,
                    time.perf_counter() - started, result.lost)
    if swap is not None:
        out["replica_minutes"] = round(out["replica_minutes"] + swap.replica_seconds / 60, 1)
        done = None if swap.done_at is None else round(swap.done_at - w.swap_at)
        out["swap"] = {"from": w.swap_at, "done_after_s": done}
    return out


def summarize(w: Workload, admission: str, signal: str, startup_s: float, capacity: float,
              requests: list[SimRequest], provisioner: Provisioner, wall_s: float, lost: int) -> dict:
    bands: dict[str, dict] = {}
    for name in sorted({r.tenant for r in requests}):
        mine = [r for r in requests if r.tenant == name]
        worst = 1.0
        for lo in range(0, int(w.duration_s - WORST_WINDOW_S) + 1, 60):
            window = [r for r in mine if lo <= r.arrival < lo + WORST_WINDOW_S]
            if window:
                worst = min(worst, sum(map(within_slo, window)) / len(window))
        bands[name] = {"offered": len(mine), "attainment": round(sum(map(within_slo, mine)) / len(mine), 4),
                       "worst_5min": round(worst, 4)}
    good = sum(map(within_slo, requests))
    out = {"scenario": w.name, "admission": admission, "signal": signal, "startup_s": startup_s,
           "capacity_rps": round(capacity, 3), "offered": len(requests), "lost": lost,
           "goodput_rps": round(good / w.duration_s, 3), "replica_minutes": round(provisioner.replica_seconds / 60, 1),
           "max_paid": max((h["paid"] for h in provisioner.history), default=0), "tenants": bands,
           "wall_s": round(wall_s, 1)}
    if w.burst is not None:
        start, end = w.burst
        before = [h["paid"] for h in provisioner.history if h["t"] < start]
        size = before[-1] if before else w.start_replicas  # what it ran before the burst
        after = [h for h in provisioner.history if h["t"] >= start]
        grew_to = max((h["paid"] for h in after), default=size)
        peak_at = next((h["t"] for h in after if h["paid"] == grew_to), end)
        back = next((h["t"] for h in after if h["t"] >= peak_at and h["paid"] <= size), None)
        # after the burst's end: how long until the fleet was its size before it again (0: it
        # never grew; None: not by the end of the run)
        out["burst"] = {"size_before": size, "grew_to": grew_to,
                        "right_sized_after_s": 0 if grew_to <= size else (None if back is None else round(back - end))}
    # the autoscaler's every decision, as rows (a column each, to keep the saved runs small)
    out["history"] = {"columns": HISTORY, "rows": [[h[k] for k in HISTORY] for h in provisioner.history]}
    return out


def main(scenarios: list[str], admissions: list[str], signals: list[str], startup_s: float, seed: int,
         out: str | None) -> list[dict]:
    rows = []
    print(f"{'scenario':<9}{'admission':<10}{'signal':<18}{'goodput':>9}{'repl-min':>10}{'max':>5}"
          f"{'interactive':>13}{'worst 5m':>10}{'standard':>10}{'batch':>8}{'right-sized':>13}")
    for s in scenarios:
        for a in admissions:
            for sig in signals:
                r = run(s, a, sig, startup_s, seed)
                rows.append(r)
                t = r["tenants"]
                burst = r.get("burst")
                sized = "-" if burst is None else burst["right_sized_after_s"]
                print(f"{s:<9}{a:<10}{sig:<18}{r['goodput_rps']:>9.2f}{r['replica_minutes']:>10.1f}{r['max_paid']:>5}"
                      f"{t['interactive']['attainment']:>13.2%}{t['interactive']['worst_5min']:>10.2%}"
                      f"{t['standard']['attainment']:>10.2%}{t['batch']['attainment']:>8.2%}"
                      f"{'never' if sized is None else sized:>13}",
                      flush=True)
    if out:
        with open(out, "w") as f:
            f.write(dumps({"startup_s": startup_s, "seed": seed, "rows": rows}) + "\n")
    return rows


def dumps(result: dict) -> str:
    """Indented JSON with each history row on one line."""
    text = json.dumps(result, indent=1)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
