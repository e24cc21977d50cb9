"""The demand signal, measured: under N replicas' worth of load, does it read N replicas?

One replica in the simulator, Bouncer in front as shipped (step time learned), offered `load` x
that replica's capacity (its completions per second under a saturating closed loop of the same
mix, `measure_capacity`: load 1 is exactly what one replica serves). Past load 1 most of it is
refused or times out, which is the point: refused requests are demand too. The core's demand
gauge (`CoreView.demand`, what `/metrics` exports) is read every `SAMPLE_S` simulated seconds
after `WARM_S`; the truth is the first attempts offered per second over the capacity.

Two arrival patterns: `steady` (Poisson arrivals, requests drawn from the scenario's traces) and
`trace` (each trace's own arrival pattern, time-scaled, whose rate itself swings: the reading
follows it, so its spread there is the trace's, not the estimator's).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

from bouncer.bench.goodput import fleet_capacity, fleet_config, make_policy
from bouncer.sim.fleet import FleetSim
from bouncer.sim.policies import SIM_MODEL
from bouncer.sim.profiles import DEFAULT_PROFILE
from bouncer.sim.scenarios import get_scenario
from bouncer.sim.workloads import make_requests, steady_requests

WARM_S = 120.0  # four of the signal's 30 s windows, and the step time's warm-up
SAMPLE_S = 5.0
WITHIN = 0.15  # the bound on a reading's error


def measure(scenario_name: str, load: float, arrivals: str = "steady", duration_s: float = 600.0, seed: int = 0,
            step_time: str = "learned", trace: str | None = None) -> dict:
    scenario = get_scenario(scenario_name, duration_s)
    traces = scenario.load(trace)
    capacity = fleet_capacity(scenario, traces, 1, DEFAULT_PROFILE, seed, trace)
    tenants = [dataclasses.replace(t, bursts=()) for t in scenario.tenants]  # a steady load: no bursts
    make = steady_requests if arrivals == "steady" else make_requests
    requests = make(tenants, traces, load * capacity, duration_s, seed)
    cfg = fleet_config("bouncer", 1, DEFAULT_PROFILE, seed, scenario)
    gw = make_policy("bouncer", scenario, cfg, step_time=step_time)
    samples: list[tuple[float, float, dict]] = []

    def sample(now: float) -> None:
        if WARM_S <= now <= duration_s:
            demand = gw.core.view.demand(SIM_MODEL, now)  # the gauge as /metrics exports it
            samples.append((demand["all"].replicas, demand["protected"].replicas, demand["all"].as_dict()))

    fleet = FleetSim(cfg, gw, gw.replica_names)
    fleet.record(SAMPLE_S, sample)
    started = time.perf_counter()
    fleet.run(requests)
    wall = time.perf_counter() - started
    offered = sum(1 for r in requests if r.arrival >= WARM_S) / (duration_s - WARM_S)
    truth = offered / capacity
    readings = [s[0] for s in samples]
    mean = statistics.fmean(readings)
    deciles = statistics.quantiles(readings, n=10)
    last = samples[-1][2]
    return {"scenario": scenario_name, "trace": trace, "arrivals": arrivals, "load": load, "seed": seed,
            "step_time": step_time, "duration_s": duration_s, "capacity_rps": round(capacity, 3),
            "offered_rps": round(offered, 3), "true_replicas": round(truth, 3),
            "reading_mean": round(mean, 3), "ratio": round(mean / truth, 3),
            "reading_p10": round(deciles[0], 3), "reading_p90": round(deciles[-1], 3),
            "samples_within": round(sum(abs(r / truth - 1) <= WITHIN for r in readings) / len(readings), 3),
            "protected_mean": round(statistics.fmean(s[1] for s in samples), 3),
            "batch_mean": round(statistics.fmean(s[2]["batch"] for s in samples), 1),
            "cost_s_mean": round(statistics.fmean(s[2]["cost_s"] for s in samples), 5),
            "prefix_hit_rate": last["prefix_hit_rate"], "samples": len(readings), "wall_s": round(wall, 1)}


def main(scenarios: list[str], loads: list[float], arrivals: list[str], duration_s: float, seed: int,
         trace: str | None, out: str | None) -> list[dict]:
    rows = []
    print(f"{'scenario':<26}{'arrivals':<9}{'load':>5}{'offered':>9}{'truth':>7}{'reads':>7}{'ratio':>7}"
          f"{'p10':>7}{'p90':>7}{'in 15%':>8}{'batch':>7}{'hits':>6}")
    for name in scenarios:
        for pattern in arrivals:
            for load in loads:
                r = measure(name, load, pattern, duration_s, seed, trace=trace)
                rows.append(r)
                label = name if trace is None else f"{name}:{trace.rstrip('/').rsplit('/', 1)[-1]}"
                print(f"{label:<26}{pattern:<9}{load:>5g}{r['offered_rps']:>9.2f}{r['true_replicas']:>7.2f}"
                      f"{r['reading_mean']:>7.2f}{r['ratio']:>7.3f}{r['reading_p10']:>7.2f}{r['reading_p90']:>7.2f}"
                      f"{r['samples_within']:>8.0%}{r['batch_mean']:>7.0f}{r['prefix_hit_rate']:>6.0%}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"within": WITHIN, "warm_s": WARM_S, "sample_s": SAMPLE_S, "rows": rows}, f, indent=1)
            f.write("\n")
    return rows
