"""Quotas and overflow in the simulator: what demotion and diversion buy over refusal.

Requests of the Azure conversation trace, Poisson arrivals; a replica's capacity (req/s) as
`bench demand` measures it (a saturating closed loop of the mix, no admission). Bouncer as
shipped, step time given. Tenants: `interactive` (band 1, TTFT 1 s, TPOT 0.1 s), `standard`
(band 0, TTFT 5 s), and per scenario:

- `demote`: 2 replicas, 40 minutes. `pt` (band 1, TTFT 5 s: a provisioned-throughput tenant,
  its committed traffic goes before the standard band's) sends 0.2 of the pool's capacity, and
  from 20 minutes 0.6 (a batch job starts); its hourly quota (total tokens) is what its first 20
  minutes' rate sends in half an hour, so the job spends the rest within minutes. Beside it
  interactive 0.25 and standard 0.30 of the capacity: 0.75 in all before the job, 1.15 with it.
  Policies: `none` (no quota: pt's whole job in band 1), `refuse` (past the quota, 429),
  `demote` (past it, band -1: sheddable). The claim: demote keeps pt's in-quota requests at their SLO and the
  other tenants where refusal keeps them, while serving pt's overflow from spare capacity.
- `divert`: 2 primary replicas and a spare pool (another model of the config, its overflow
  target), 10 minutes, interactive 0.3, standard 0.4 and `batch` (band -1, TTFT 30 s) 0.3 of
  `load` x the primary's capacity. Policies: `refuse` (no tenant may overflow: the spare pool
  idles) and `divert` (every tenant may): goodput (completed within SLO, per second, both pools).
  The spare pool has 2 replicas by default (an external provider is larger still); `spare` sets it.

Reported per policy: each tenant's offered, completed and within-SLO counts, before and after
the quota ran out (demote), and goodput (divert).
"""

from __future__ import annotations

import dataclasses
import json
import time

from bouncer.bench.goodput import _step_time_config, fleet_capacity, fleet_config, within_slo
from bouncer.sim.fleet import FleetSim, SimRequest
from bouncer.sim.policies import BOUNCER_POLICY, CorePolicy, core_config, tenant_config
from bouncer.sim.profiles import DEFAULT_PROFILE
from bouncer.sim.scenarios import AZURE_CONV, get_scenario
from bouncer.sim.traces import load_trace
from bouncer.sim.workloads import TenantSpec, steady_requests

SCENARIOS = ("demote", "divert")
EPOCH = 1_798_761_600.0  # 2027-01-01T00:00Z: simulated second 0 starts an hour window
SPARE = "sim-llm-spare"

INTERACTIVE = TenantSpec("interactive", priority=1, share=0.3, trace="conv", ttft_slo=1.0, tpot_slo=0.1,
                         max_tokens=1024)
STANDARD = TenantSpec("standard", priority=0, share=0.4, trace="conv", ttft_slo=5.0, max_tokens=1024)
BATCH = TenantSpec("batch", priority=-1, share=0.3, trace="conv", ttft_slo=30.0, max_tokens=1024, timeout_s=120.0)
PT = TenantSpec("pt", priority=1, share=0.0, trace="conv", ttft_slo=5.0, max_tokens=1024)

DEMOTE_S = 2400.0  # its job starts halfway
PT_RATE, JOB_RATE = 0.2, 0.6  # of the pool's capacity: pt's before its job, and with it
DIVERT_S = 600.0


def _capacity(seed: int) -> float:
    """One replica's capacity for the interactive/standard/batch mix (as `bench autoscaling`)."""
    base = get_scenario("surge", 600.0)
    one = dataclasses.replace(base, tenants=[INTERACTIVE, STANDARD, BATCH], name="autoscaling")
    return fleet_capacity(one, {"conv": load_trace(AZURE_CONV)}, 1, DEFAULT_PROFILE, seed, None)


def _policy(replicas: int, spare: int, tenants: list[dict], extra: dict, seed: int):
    cfg = fleet_config("bouncer", replicas + spare, DEFAULT_PROFILE, seed, get_scenario("surge", 60.0))
    pools = {SPARE: [f"r{i}" for i in range(replicas, replicas + spare)]} if spare else None
    config = core_config(tenants, cfg.roles(), cfg.kv_blocks or cfg.profile.num_blocks, cfg.profile.block_size,
                         cfg.profile.max_model_len, BOUNCER_POLICY, step_time=_step_time_config(cfg, "given"),
                         max_num_seqs=cfg.profile.max_num_seqs, pools=pools, extra=extra)
    return cfg, CorePolicy("bouncer", config, quota_epoch=EPOCH)


def _tenant(spec: TenantSpec, **kw) -> dict:
    return tenant_config(spec.name, spec.priority, max_tokens_cap=spec.max_tokens,
                         max_tokens_default=min(512, spec.max_tokens),
                         slo={"ttft_s": spec.ttft_slo, "tpot_s": spec.tpot_slo}, **kw)


def _counts(requests: list[SimRequest], lo: float = 0.0, hi: float = float("inf")) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in requests:
        if lo <= r.arrival < hi:
            c = out.setdefault(r.tenant, {"offered": 0, "completed": 0, "within_slo": 0})
            c["offered"] += 1
            c["completed"] += r.outcome == "completed"
            c["within_slo"] += within_slo(r)
    for c in out.values():
        c["attainment"] = round(c["within_slo"] / c["offered"], 4) if c["offered"] else None
    return out


def demote(policy: str, seed: int = 0, duration_s: float = DEMOTE_S) -> dict:
    """One run of the `demote` scenario under `policy` (none, refuse or demote)."""
    capacity = 2 * _capacity(seed)
    traces = {"conv": load_trace(AZURE_CONV)}
    job_at = duration_s / 2
    steady = steady_requests([INTERACTIVE], traces, 0.25 * capacity, duration_s, seed)
    steady += steady_requests([STANDARD], traces, 0.30 * capacity, duration_s, seed + 1)
    pt = steady_requests([PT], traces, JOB_RATE * capacity, duration_s, seed + 2,
                         lambda t: 1.0 if t >= job_at else PT_RATE / JOB_RATE, 1.0)
    requests = sorted(steady + pt, key=lambda r: r.arrival)
    # its hourly quota: what its rate before the job sends in 1.5 times as long as that lasted
    # (in the 40 minutes' run, half an hour)
    quota = sum(r.prompt_len + r.output_len for r in pt if r.arrival < job_at) * 1.5
    tenants = [_tenant(INTERACTIVE), _tenant(STANDARD)]
    extra: dict = {}
    if policy == "none":
        tenants.append(_tenant(PT))
    else:
        tenants.append(_tenant(PT, quota={"limits": [{"window": "hour", "unit": "total_tokens", "limit": quota}],
                                          "over": policy, "demote_band": -1}))
        extra["quotas"] = {"url": "redis://simulated:6379/0"}  # (the simulator keeps spend in-process)
    cfg, gw = _policy(2, 0, tenants, extra, seed)
    started = time.perf_counter()
    FleetSim(cfg, gw, gw.replica_names).run(requests)
    over_at = gw.quotas.first_over.get("pt") if gw.quotas is not None else None
    split = over_at if over_at is not None else job_at
    return {"scenario": "demote", "policy": policy, "seed": seed, "duration_s": duration_s,
            "capacity_rps": round(capacity, 3),
            "quota_tokens": round(quota), "quota_spent_at_s": None if over_at is None else round(over_at, 1),
            "before": _counts(requests, 0.0, split), "after": _counts(requests, split),
            "lost": sum(r.outcome is None for r in requests), "wall_s": round(time.perf_counter() - started, 1)}


def divert(policy: str, load: float, seed: int = 0, spare: int = 2, duration_s: float = DIVERT_S) -> dict:
    """One run of the `divert` scenario under `policy` (refuse or divert) at `load`, with a
    spare pool of `spare` replicas."""
    capacity = 2 * _capacity(seed)
    traces = {"conv": load_trace(AZURE_CONV)}
    mix = [INTERACTIVE, STANDARD, BATCH]
    requests = steady_requests(mix, traces, load * capacity, duration_s, seed)
    tenants = [_tenant(t, overflow=policy == "divert") for t in mix]
    extra = {"models": {"sim-llm": {"overflow": [{"name": "spare-pool", "model": SPARE}]}}}
    cfg, gw = _policy(2, spare, tenants, extra, seed)
    started = time.perf_counter()
    FleetSim(cfg, gw, gw.replica_names).run(requests)
    counts = _counts(requests)
    good = sum(c["within_slo"] for c in counts.values())
    diverted = sum(n for (outcome, *_), n in gw.core.view.stats.decisions.items() if outcome == "diverted")
    return {"scenario": "divert", "policy": policy, "load": load, "spare": spare, "seed": seed,
            "capacity_rps": round(capacity, 3),
            "goodput_rps": round(good / duration_s, 3), "diverted": diverted, "tenants": counts,
            "lost": sum(r.outcome is None for r in requests), "wall_s": round(time.perf_counter() - started, 1)}


def main(scenarios: list[str], loads: list[float], spares: list[int], seed: int, out: str | None) -> list[dict]:
    rows: list[dict] = []
    if "demote" in scenarios:
        print(f"{'demote':<8}{'policy':<8}{'spent at':>9}  {'after the quota ran out: within SLO / offered':<56}"
              f"{'pt before':>13}")
        for policy in ("none", "refuse", "demote"):
            r = demote(policy, seed)
            rows.append(r)
            after = "  ".join(f"{t} {c['within_slo']}/{c['offered']}" for t, c in sorted(r["after"].items()))
            pt = r["before"].get("pt", {})
            print(f"{'':<8}{policy:<8}{r['quota_spent_at_s'] or '-':>9}  {after:<56}"
                  f"{pt.get('within_slo', 0):>6}/{pt.get('offered', 0):<6}", flush=True)
    if "divert" in scenarios:
        print(f"{'divert':<8}{'policy':<8}{'load':>5}{'spare':>6}{'goodput':>9}{'ratio':>7}{'diverted':>10}")
        for load in loads:
            for spare in spares:
                base = None
                for policy in ("refuse", "divert"):
                    r = divert(policy, load, seed, spare)
                    rows.append(r)
                    base = base or r["goodput_rps"]
                    print(f"{'':<8}{policy:<8}{load:>5g}{spare:>6}{r['goodput_rps']:>9.2f}"
                          f"{r['goodput_rps'] / base:>7.2f}{r['diverted']:>10}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
            f.write("\n")
    return rows
