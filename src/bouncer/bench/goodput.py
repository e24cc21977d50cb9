"""`bouncer bench run` and `bouncer bench report`: goodput under overload, Bouncer against the
peers' admission policies, in the fleet simulator.

A request counts toward goodput when it completed within its tenant's TTFT and TPOT SLO, with
latency measured from the user's first attempt (retries included).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import math
import os
import pathlib

from bouncer.config import Routing
from bouncer.core.fleet.blocks import leading_run
from bouncer.core.registry import make_router
from bouncer.core.stores import Stores
from bouncer.recorder.sampler import Sampler
from bouncer.recorder.timeline import Timeline
from bouncer.sim.fleet import FleetConfig, FleetSim, SimRequest
from bouncer.sim.pd_policies import PdCurrentLoad, PdDynamoBusy, PdRoundRobin
from bouncer.sim.policies import (
    BOUNCER_POLICY,
    LLMD_POLICY,
    CorePolicy,
    DynamoBusy,
    NoAdmission,
    TgiCap,
    VllmQueueCap,
    core_config,
    merged,
    tenant_config,
)
from bouncer.sim.profiles import EngineProfile, get_profile
from bouncer.sim.scenarios import Scenario, get_scenario
from bouncer.sim.several_gateways import Gateways, GatewaySetup
from bouncer.sim.workloads import TenantSpec, make_requests, measure_capacity

POLICIES = ("none", "tgi-cap", "vllm-queue-cap", "llmd-flow-control", "dynamo-busy", "pd-current-load", "bouncer")
# on a disaggregated fleet (bouncer.sim.pd_policies): TGI has no P/D mode, and llm-d's flow
# control is not modelled on two pools
PD_POLICIES = ("none", "vllm-queue-cap", "dynamo-busy", "pd-current-load", "bouncer")
DEFAULT_PROFILE = "llama-3.1-8b-h100"
# vLLM's default is no queue cap; the `vllm-queue-cap` baseline runs engines with these (a
# common production choice: a few hundred waiting requests per engine).
VLLM_MAX_QUEUED_REQS = 256
VLLM_MAX_QUEUED_TOKENS = 262_144
LLMD_SCRAPE_INTERVAL_S = 0.05  # llm-d's --refresh-metrics-interval default (50 ms)
# measured capacities are cached here (per scenario, fleet and trace); BOUNCER_CACHE_DIR moves it
CACHE_DIR = pathlib.Path(os.environ.get("BOUNCER_CACHE_DIR", ".cache")) / "capacity"


def engine_profile(profile: str | EngineProfile) -> EngineProfile:
    """A profile by name, or one given whole (`bouncer bench live`'s, scaled to its engines)."""
    return profile if isinstance(profile, EngineProfile) else get_profile(profile)


def fleet_config(policy: str, replicas: int, profile: str | EngineProfile, seed: int, scenario: Scenario,
                 kv_events: bool = False) -> FleetConfig:
    profile = dataclasses.replace(engine_profile(profile), max_model_len=scenario.max_model_len)
    cfg = FleetConfig(replicas=replicas, profile=profile, seed=seed, kv_events=kv_events,
                      cpu_offload_gib=scenario.cpu_offload_gib)
    if scenario.disaggregated:
        cfg.replicas, cfg.decode_replicas = scenario.pd_split(profile, replicas)
    if policy == "vllm-queue-cap":
        cfg.max_num_queued_reqs = VLLM_MAX_QUEUED_REQS
        cfg.max_num_queued_tokens = VLLM_MAX_QUEUED_TOKENS
    if policy == "llmd-flow-control":
        cfg.scrape_interval_s = LLMD_SCRAPE_INTERVAL_S
    return cfg


def tenant_configs(scenario: Scenario) -> list[dict]:
    return [tenant_config(t.name, t.priority, t.weight, max_tokens_cap=t.max_tokens,
                          max_tokens_default=min(512, t.max_tokens), slo={"ttft_s": t.ttft_slo, "tpot_s": t.tpot_slo})
            for t in scenario.tenants]


STEP_TIMES = ("given", "learned", "off")


def make_policy(name: str, scenario: Scenario, cfg: FleetConfig, routing: str | None = None,
                policy_set: dict | None = None, step_time: str = "given", stores: Stores | None = None,
                cache_isolation: bool = False):
    """`step_time` (bouncer only): `given`, the profile's coefficients stated in the config as an
    operator who measured them would; `learned`, fitted online from the requests (only the
    engine's token budget stated, which operators set themselves); `off`, no latency prediction.
    `stores` (bouncer and llmd-flow-control): the core's, where it shares some with other gateways."""
    names = [f"r{i}" for i in range(cfg.replicas)]
    blocks = cfg.kv_blocks or cfg.profile.num_blocks
    if cfg.decode_replicas and name not in ("bouncer", "llmd-flow-control"):
        return _pd_baseline(name, scenario, cfg, blocks)
    if name == "pd-current-load":
        raise ValueError("pd-current-load needs a disaggregated fleet (the disaggregated scenario)")
    if name == "none":
        router = make_router(routing, Routing()) if routing else None
        return NoAdmission(names, router, blocks, cfg.profile.block_size,
                           cfg.profile.offload_blocks(cfg.cpu_offload_gib))
    if name == "tgi-cap":
        return TgiCap(names)
    if name == "vllm-queue-cap":
        return VllmQueueCap(names)
    if name == "dynamo-busy":
        return DynamoBusy(names, blocks, cfg.profile.block_size, cfg.profile.max_num_batched_tokens)
    if name in ("llmd-flow-control", "bouncer"):
        policy = LLMD_POLICY if name == "llmd-flow-control" else BOUNCER_POLICY
        if routing:
            policy = {**policy, "routing": {**policy.get("routing", {}), "router": routing}}
        if policy_set:
            policy = merged(policy, policy_set)
        offload = cfg.profile.offload_blocks(cfg.cpu_offload_gib)
        # llm-d predicts no latency
        step = _step_time_config(cfg, step_time) if name == "bouncer" else {"mode": "off"}
        if cfg.decode_replicas and name != "bouncer":
            raise ValueError(f"{name} is not modelled on a disaggregated fleet; known there: {', '.join(PD_POLICIES)}")
        return CorePolicy(name, core_config(tenant_configs(scenario), cfg.roles(), blocks, cfg.profile.block_size,
                                           cfg.profile.max_model_len, policy, offload, step,
                                           cfg.max_num_seqs or cfg.profile.max_num_seqs,
                                           cache_isolation=cache_isolation and name == "bouncer"),
                          advises_clients=name == "bouncer", stores=stores)
    raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")


def _pd_baseline(name: str, scenario: Scenario, cfg: FleetConfig, blocks: int):
    roles = cfg.roles()
    if name in ("none", "vllm-queue-cap"):
        return PdRoundRobin(roles, name)
    if name == "dynamo-busy":
        return PdDynamoBusy(roles, blocks, cfg.profile.block_size, cfg.profile.max_num_batched_tokens)
    if name == "pd-current-load":
        return PdCurrentLoad(roles, cfg.profile.prefill_seconds)
    raise ValueError(f"{name} is not modelled on a disaggregated fleet; known there: {', '.join(PD_POLICIES)}")


def _step_time_config(cfg: FleetConfig, step_time: str) -> dict:
    if step_time == "given":
        return cfg.profile.step_time_config
    if step_time == "learned":
        return {"mode": "learned", "max_batched_tokens": cfg.profile.max_num_batched_tokens}
    if step_time == "off":
        return {"mode": "off"}
    raise ValueError(f"unknown step time {step_time!r}; known: {', '.join(STEP_TIMES)}")


def _check_policy_set(policy: str, policy_set: dict | None) -> None:
    if policy_set and policy not in ("bouncer", "llmd-flow-control"):
        raise ValueError(f"policy settings apply to bouncer and llmd-flow-control, not {policy!r}")


def fleet_capacity(scenario: Scenario, traces, replicas: int, profile: str | EngineProfile, seed: int,
                   trace: str | None) -> float:
    """Capacity (req/s) of this fleet for this scenario's mix; measured once and cached."""
    # the profile's coefficients are in the key: a changed engine model measures again
    prof = engine_profile(profile)
    key = hashlib.sha256(json.dumps([scenario.name, replicas, repr(prof), trace or "",
                                     scenario.max_model_len,
                                     scenario.cpu_offload_gib,
                                     [(t.name, t.share, t.trace, t.min_prompt, t.max_tokens) for t in scenario.tenants]]
                                    ).encode()).hexdigest()[:16]
    path = CACHE_DIR / f"{scenario.name}-{replicas}x{prof.name}-{key}.json"
    if path.exists():
        return json.loads(path.read_text())["capacity_rps"]
    cfg = fleet_config("none", replicas, profile, seed, scenario)
    base = [dataclasses.replace(t, bursts=()) for t in scenario.tenants]
    cap = measure_capacity(cfg, lambda: make_policy("none", scenario, cfg), base, traces, seed=seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"capacity_rps": cap, "scenario": scenario.name, "replicas": replicas,
                                "profile": prof.name, "trace": trace}))
    return cap


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _tpot(r: SimRequest) -> float | None:
    if r.first_token_at is None or r.finished_at is None or r.output_len <= 1:
        return None
    return (r.finished_at - r.first_token_at) / (r.output_len - 1)


def within_slo(r: SimRequest) -> bool:
    """Whether it counts toward goodput: completed, its first token within its TTFT SLO of its
    first attempt's arrival, and its TPOT within its TPOT SLO."""
    if r.outcome != "completed":
        return False
    if r.ttft_slo is not None and r.first_token_at - r.arrival > r.ttft_slo:
        return False
    tpot = _tpot(r)
    return r.tpot_slo is None or tpot is None or tpot <= r.tpot_slo


def tenant_outcomes(spec: TenantSpec, mine: list[SimRequest]) -> dict:
    """One tenant's requests, ended: how many, how many within SLO, their latencies."""
    done = [r for r in mine if r.outcome == "completed"]
    return {
        "priority": spec.priority, "weight": spec.weight, "offered": len(mine),
        "completed": len(done),
        "slo_attainment": sum(1 for r in mine if within_slo(r)) / len(mine) if mine else None,
        "ttft_p50_s": _pct([r.first_token_at - r.arrival for r in done], 0.5),
        "ttft_p99_s": _pct([r.first_token_at - r.arrival for r in done], 0.99),
        "tpot_p50_s": _pct([t for r in done if (t := _tpot(r)) is not None], 0.5),
        "tpot_p99_s": _pct([t for r in done if (t := _tpot(r)) is not None], 0.99),
        "slo_misses": _misses(mine),
    }


def ttft_minus_slo(requests: list[SimRequest]) -> dict[int, dict]:
    """Per band, of its completed requests with a TTFT SLO: how far before (< 0) or after their
    deadline their first token came (from the first attempt), p10 to p99. A band whose requests
    keep getting theirs just before the deadline is served at the edge of its budget; one with
    p50 above 0 is served late."""
    by_band: dict[int, list[float]] = {}
    for r in requests:
        if r.outcome == "completed" and r.ttft_slo is not None:
            by_band.setdefault(r.priority, []).append(r.first_token_at - r.arrival - r.ttft_slo)
    return {band: {"completed": len(v), **{f"p{round(q * 100)}_s": _pct(v, q) for q in (0.1, 0.5, 0.9, 0.99)}}
            for band, v in sorted(by_band.items())}


def _misses(requests: list[SimRequest]) -> dict[str, int]:
    """Why requests did not count toward goodput: not completed (by outcome); or completed late
    on TTFT, on the first attempt or on a retry (latency counts from the first); or on TPOT."""
    out = {"late_ttft_first_attempt": 0, "late_ttft_on_retry": 0, "late_tpot": 0}
    for r in requests:
        if within_slo(r):
            continue
        if r.outcome != "completed":
            out[r.outcome] = out.get(r.outcome, 0) + 1  # type: ignore[index]
        elif r.ttft_slo is not None and r.first_token_at - r.arrival > r.ttft_slo:
            out["late_ttft_on_retry" if r.attempt > 1 else "late_ttft_first_attempt"] += 1
        else:
            out["late_tpot"] += 1
    return out


def run(scenario_name: str, policy: str, load: float, seed: int = 0, replicas: int = 4, duration_s: float = 300.0,
        trace: str | None = None, profile: str | EngineProfile = DEFAULT_PROFILE, routing: str | None = None,
        kv_events: bool = False, only_tenants: list[str] | None = None, policy_set: dict | None = None,
        step_time: str = "given", record: Timeline | None = None, gateways: GatewaySetup | None = None,
        trace_start_h: float | None = None, tenancy: str = "banded", cache_isolation: bool = False) -> dict:
    """One run, summarized. `routing` overrides the policy's router; `kv_events` has the engines
    publish their prefix-cache changes, which Bouncer's core uses to make its prefix index precise;
    `only_tenants` drops the other tenants' requests (capacity and arrivals stay those of the
    whole mix); `policy_set` changes policy settings (nested, as in the config's `policy`);
    `step_time` is what Bouncer knows of the engine's step time (`make_policy`); `gateways`: several
    gateways, each with its own core, sharing state or not (`bouncer.sim.several_gateways`);
    `trace_start_h`: the hour of a ServeGen trace replayed, from that many hours in (default:
    its busiest); `tenancy`: how its clients become tenants (`servegen_tenants`); `cache_isolation`:
    Bouncer keeps each tenant's prefixes in a cache of its own on the engines (`core_config` says
    why the scenarios run without)."""
    scenario, capacity, requests, result = simulate(scenario_name, policy, load, seed, replicas, duration_s, trace,
                                                    profile, routing, kv_events, only_tenants, policy_set, step_time,
                                                    record, gateways, trace_start_h, tenancy, cache_isolation)
    out = summarize(scenario, policy, load, seed, replicas, duration_s, capacity, requests, result, routing)
    out["kv_events"] = kv_events
    out["only_tenants"] = only_tenants
    out["policy_set"] = policy_set or {}
    if step_time != "given":  # recorded where it differs from every published run's
        out["step_time"] = step_time
    if gateways is not None and gateways.count > 1:
        out["gateways"] = gateways.describe()
    if trace_start_h is not None:
        out["trace_start_h"] = trace_start_h
    if tenancy != "banded":
        out["tenancy"] = tenancy
    if cache_isolation:
        out["cache_isolation"] = True
    return out


def simulate(scenario_name: str, policy: str, load: float, seed: int, replicas: int, duration_s: float,
             trace: str | None = None, profile: str | EngineProfile = DEFAULT_PROFILE, routing: str | None = None,
             kv_events: bool = False, only_tenants: list[str] | None = None, policy_set: dict | None = None,
             step_time: str = "given", record: Timeline | None = None, gateways: GatewaySetup | None = None,
             trace_start_h: float | None = None, tenancy: str = "banded", cache_isolation: bool = False):
    """The run itself, as `run` describes it: (scenario, capacity in req/s, requests with their
    outcomes, the fleet's result). With `record`, Bouncer's core is sampled into it every
    `record.step_s` of simulated time, as the gateway's flight recorder samples it."""
    _check_policy_set(policy, policy_set)
    scenario = get_scenario(scenario_name, duration_s)
    traces = scenario.load(trace, trace_start_h, tenancy)
    # another hour of a trace is another mix: measured apart
    capacity = fleet_capacity(scenario, traces, replicas, profile, seed,
                              trace if trace_start_h is None else f"{trace}@{trace_start_h:g}h")
    requests = make_requests(scenario.tenants, traces, load * capacity, duration_s, seed)
    if only_tenants:
        unknown = set(only_tenants) - {t.name for t in scenario.tenants}
        if unknown:
            raise ValueError(f"unknown tenant(s) {', '.join(sorted(unknown))} in scenario {scenario_name!r}; "
                             f"known: {', '.join(t.name for t in scenario.tenants)}")
        scenario.tenants = [t for t in scenario.tenants if t.name in only_tenants]
        requests = [r for r in requests if r.tenant in only_tenants]
    cfg = fleet_config(policy, replicas, profile, seed, scenario, kv_events)
    if gateways is not None and gateways.count > 1:
        if policy not in ("bouncer", "llmd-flow-control"):
            raise ValueError(f"--gateways runs several admission cores: {policy!r} has none "
                             "(bouncer and llmd-flow-control do)")
        gw = Gateways(gateways, lambda stores: make_policy(policy, scenario, cfg, routing, policy_set, step_time,
                                                           stores, cache_isolation))
    else:
        gw = make_policy(policy, scenario, cfg, routing, policy_set, step_time, cache_isolation=cache_isolation)
    fleet = FleetSim(cfg, gw, gw.replica_names)
    if record is not None:
        if not isinstance(gw, CorePolicy | Gateways):
            raise ValueError(f"--record samples an admission core: {policy!r} has none "
                             "(bouncer and llmd-flow-control do)")
        sampler = Sampler()
        fleet.record(record.step_s, lambda now: record.append(sampler.sample(gw.core.view, now, now)))
    return scenario, capacity, requests, fleet.run(requests)


def prefix_hit_bound(requests: list[SimRequest], block_size: int) -> float:
    """The hit rate of one infinite prefix cache that saw `requests` in arrival order: the share
    of prompt tokens whose block prefix an earlier request already had (the last prompt token is
    always computed, as vLLM does)."""
    seen: set[int] = set()
    hits = total = 0
    for r in sorted(requests, key=lambda r: r.arrival):
        hits += min(leading_run(r.block_digests, seen) * block_size, r.prompt_len - 1)
        total += r.prompt_len
        seen.update(r.block_digests)
    return hits / total if total else 0.0


def retry_after_accuracy(result) -> dict[str, dict]:
    """Per refusal reason: the Retry-After each refusal gave against what happened, as given /
    actual, where actual is how long from the refusal until a request of that tenant sent after
    it was admitted (what a client coming back then would have waited, at the soonest).
    Refusals after which no later request of the tenant was admitted are counted apart."""
    # per tenant: attempts by send time, and the earliest admission among those sent at or after each
    by_tenant: dict[str, tuple[list[float], list[float]]] = {}
    for tenant, pairs in result.admissions.items():
        pairs = sorted(pairs)
        soonest, best = [0.0] * len(pairs), math.inf
        for i in range(len(pairs) - 1, -1, -1):
            best = min(best, pairs[i][1])
            soonest[i] = best
        by_tenant[tenant] = ([sent for sent, _ in pairs], soonest)
    ratios: dict[str, list[float]] = {}
    never: dict[str, int] = {}
    for t, tenant, reason, given in result.retry_afters:
        sent, soonest = by_tenant.get(tenant, ([], []))
        i = bisect.bisect_right(sent, t)
        if i == len(sent):
            never[reason] = never.get(reason, 0) + 1
            continue
        actual = soonest[i] - t
        ratios.setdefault(reason, []).append(given / actual if actual > 0 else math.inf)
    out: dict[str, dict] = {}
    for reason in sorted(set(ratios) | set(never)):
        r = ratios.get(reason, [])
        out[reason] = {"refusals": len(r) + never.get(reason, 0), "no_later_admission": never.get(reason, 0),
                       "median_ratio": _pct(r, 0.5), "p10_ratio": _pct(r, 0.1), "p90_ratio": _pct(r, 0.9)}
    return out


def tokens_served(requests: list[SimRequest], lo: float, hi: float) -> dict[str, float]:
    """Tokens each tenant was served within [lo, hi), of its completed requests: a prompt when
    its first token came (its prefill ends then), an answer spread evenly from then to its end.
    (Counted by when requests finished instead, a window not much longer than an answer counts
    mostly what was sent before it: at the live benchmark's engine speed, 250 tokens take 12 s.)"""
    served: dict[str, float] = {}
    for r in requests:
        start, end = r.first_token_at, r.finished_at
        if r.outcome != "completed" or start is None or end is None:
            continue
        n = r.prompt_len if lo <= start < hi else 0.0
        if end > start:
            n += r.output_len * max(0.0, min(hi, end) - max(lo, start)) / (end - start)
        elif lo <= start < hi:
            n += r.output_len
        if n:
            served[r.tenant] = served.get(r.tenant, 0.0) + n
    return served


def summarize(scenario: Scenario, policy: str, load: float, seed: int, replicas: int, duration_s: float,
              capacity: float, requests: list[SimRequest], result, routing: str | None) -> dict:
    outcomes = {k: result.outcomes.get(k, 0) for k in ("completed", "refused", "expired", "abandoned", "failed")}
    good = [r for r in requests if within_slo(r)]
    completed = [r for r in requests if r.outcome == "completed"]
    lo, hi = (f * duration_s for f in scenario.contention_window)
    served_tokens = tokens_served(requests, lo, hi)
    total_served = sum(served_tokens.values()) or 1
    tenants = {}
    for spec in scenario.tenants:
        tenants[spec.name] = {**tenant_outcomes(spec, [r for r in requests if r.tenant == spec.name]),
                              "served_token_share": served_tokens.get(spec.name, 0) / total_served}
    span = duration_s
    ttfts = [r.first_token_at - r.arrival for r in completed]
    imbalance = [x["kv_imbalance"] for x in result.samples if x.get("kv_imbalance") and x["kv_usage_mean"] >= 0.05]
    return {
        "scenario": scenario.name, "policy": policy, "load": load, "seed": seed, "replicas": replicas,
        "routing": routing or ("prefix-aware" if policy == "bouncer" else "llmd-scorers" if policy ==
                               "llmd-flow-control" else "round-robin" if policy != "dynamo-busy" else "kv-overlap"),
        "capacity_rps": capacity, "duration_s": duration_s,
        **({"decode_replicas": result.decode_replicas} if result.decode_replicas else {}),
        "sim_seconds": result.sim_seconds, "wall_seconds": result.wall_seconds,
        "sim_seconds_per_wall_second": result.sim_seconds / result.wall_seconds if result.wall_seconds else None,
        "offered": len(requests), "lost": len(requests) - sum(outcomes.values()), "outcomes": outcomes,
        "attempts": result.attempts,
        "refused_by_reason": dict(result.refused_by_reason.most_common()),
        "goodput_rps": len(good) / span,
        "goodput_tokens_per_s": sum(r.output_len for r in good) / span,
        # the same in prompt tokens: what the engines' prefill spent on answers that counted, which
        # does not depend on which requests filled it (where bands' prompts differ in size, goodput
        # in requests does)
        "goodput_prompt_tokens_per_s": sum(r.prompt_len for r in good) / span,
        "throughput_tokens_per_s": sum(r.output_len for r in completed) / span,
        "prefix_hit_rate": result.prefix_hits / result.prefix_queries if result.prefix_queries else 0.0,
        # over the requests the engines were sent: those are what their hit rate counts (a
        # request refused at the gateway is never looked up)
        "prefix_hit_bound": prefix_hit_bound([r for r in requests if r.reached_engine], 16),
        "kv_imbalance": sum(imbalance) / len(imbalance) if imbalance else None,  # mean of max/mean KV usage
        "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p99_s": _pct(ttfts, 0.99),
        "preemptions": result.preemptions,
        "recomputed_tokens": result.recomputed_tokens,
        "wasted_tokens": sum(r.wasted_tokens for r in requests),
        "refused_after_prefill": result.refused_after_prefill,
        "decode_kv": decode_kv_swing(result.samples, duration_s),
        "tenants": tenants,
        "ttft_minus_slo": ttft_minus_slo(requests),
        "retry_after_accuracy": retry_after_accuracy(result),
        "samples": result.samples,
    }


OSCILLATION_WINDOW_S = 10.0


def _std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def decode_kv_swing(samples: list[dict], duration_s: float) -> dict | None:
    """How the decode pool's KV usage moved (a disaggregated fleet's; None otherwise), from the
    simulator's 1-s samples after the first 10 s: its mean; the standard deviation within each
    10-s window, averaged over the windows (swings of a few seconds, the anti-phase oscillation
    of admission on current decode load: a wave let in while decode looks empty, arriving once
    its prefill is done); the standard deviation of the windows' means (slower drift); and the
    share of samples at 98% or more, where the engines preempt."""
    points = [(x["t"], x["decode_kv_usage_mean"]) for x in samples
              if "decode_kv_usage_mean" in x and OSCILLATION_WINDOW_S <= x["t"] < duration_s]
    if not points:
        return None
    windows: dict[int, list[float]] = {}
    for t, usage in points:
        windows.setdefault(int(t // OSCILLATION_WINDOW_S), []).append(usage)
    means = [sum(w) / len(w) for w in windows.values()]
    return {"mean": sum(u for _, u in points) / len(points),
            "std_within_10s": sum(_std(w) for w in windows.values()) / len(windows),
            "std_of_10s_means": _std(means),
            "share_at_98pct": sum(1 for _, u in points if u >= 0.98) / len(points),
            "windows": len(windows)}


def _finite(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def save(result: dict, out: str) -> None:
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(out).write_text(json.dumps(_finite(result), indent=1))
