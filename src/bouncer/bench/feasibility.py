"""SLO feasibility, measured: how good the latency predictor is, and whether the requests Bouncer
refuses as `deadline_infeasible` would really have missed.

Two measurements on one scenario (default `surge`, whose tenant has a 2 s TTFT SLO):

- **Predictor error.** Every dispatch records the TTFT and TPOT the core predicted for that
  replica (corrected online, as the gateway runs it); the engine model then says what happened.
- **Paired runs.** The run as shipped refuses infeasible requests (each refusal's `offer` call
  is timed). Then, for a sample of the requests it refused at arrival, the same run again (same
  arrivals, same seed, so identical up to that moment) lets just that one request through, in
  two ways:
  - *admitted*: as any admitted request; it leaves the queue at its latest start time (its SLO
    minus its predicted TTFT) if it has not been dispatched by then;
  - *admitted, no expiry*: it waits as long as its client lets it.
  It "missed" when its first token did not come within its TTFT SLO of its arrival (or never
  came). Arrivals after its deadline cannot change its fate and are left out of those runs.
- **Everything admitted.** The same arrivals with refusal off for every request (and the TTL
  no longer cut to the SLO): each attempt the shipped run refused that this run also saw (first
  attempts are common to both; retries differ) is looked up here: did it miss once admitted?
  Within this run, the attempts the predictor flags are compared with those it does not.

The single-request runs answer the sharper question. At the margin (and under sustained overload
the queue sits at the margin) a refused request let through is often served in time, taking the
place of a later one: `in_time_gained` counts, of the attempts offered up to its deadline, how
many more were served in time than in the shipped run.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

from bouncer.bench.goodput import fleet_capacity, fleet_config, tenant_configs
from bouncer.config import BouncerConfig
from bouncer.core.arrivals import Exemption
from bouncer.core.journey import Go, Refuse
from bouncer.sim.fleet import FleetSim, PolicyEvent, SimRequest
from bouncer.sim.policies import BOUNCER_POLICY, CorePolicy, core_config
from bouncer.sim.profiles import DEFAULT_PROFILE
from bouncer.sim.scenarios import get_scenario
from bouncer.sim.workloads import make_requests

INFEASIBLE = "slo/deadline_infeasible"


@dataclass(slots=True)
class Attempt:
    offered_at: float
    ttft_slo: float | None
    flagged: bool = False  # the core predicted it would miss its TTFT SLO
    refused_infeasible: bool = False
    refused_at_arrival: bool = False  # by its own offer() call, not later in the queue
    offer_s: float = 0.0  # core time of its offer() call
    dispatched_at: float | None = None
    predicted_ttft: float | None = None
    predicted_tpot: float | None = None
    first_token_at: float | None = None
    tpot: float | None = None


class LoggingCorePolicy(CorePolicy):
    """Bouncer's core in the simulator, logging each attempt's predictions and what came of them."""

    def __init__(self, name: str, config: BouncerConfig, let_through: str | None = None,
                 no_expiry: bool = False) -> None:
        # `let_through`: the one attempt admitted even when predicted late; with `no_expiry`,
        # kept queued as long as its client waits
        exemption = Exemption(let_through, keep_queued=no_expiry) if let_through is not None else None
        super().__init__(name, config, exemption)
        self.attempts: dict[str, Attempt] = {}

    def offer(self, req: SimRequest, now: float) -> list[PolicyEvent]:
        a = self.attempts[req.attempt_id] = Attempt(now, req.ttft_slo)
        t0 = time.perf_counter()
        steps = self.journey.offer(self._info(req), now)
        a.offer_s = time.perf_counter() - t0
        if any(isinstance(s, Refuse) and s.reject.request_id == req.attempt_id
               and s.reject.refusal.reason == "deadline_infeasible" for s in steps):
            a.refused_at_arrival = True
        events = self._convert(steps, now)
        queued = self.core.view.queued_request(req.attempt_id)
        if queued is not None and queued.predicted_late:
            a.flagged = True
        return events

    def _convert(self, steps, now: float) -> list[PolicyEvent]:
        for step in steps:
            if isinstance(step, Go):
                e = step.dispatch
                if (a := self.attempts.get(e.request_id)) is not None:
                    a.dispatched_at = e.dispatched_at
                    a.predicted_ttft, a.predicted_tpot = e.predicted_ttft_s, e.predicted_tpot_s
                    a.flagged = a.flagged or e.predicted_late
            elif isinstance(step, Refuse) and step.reject.refusal.reason == "deadline_infeasible":
                if (a := self.attempts.get(step.reject.request_id)) is not None:
                    a.flagged = a.refused_infeasible = True
        return super()._convert(steps, now)

    def started(self, attempt_id, now):
        a = self.attempts.get(attempt_id)
        if a is not None:
            a.first_token_at = now
        super().started(attempt_id, now)

    def finished(self, attempt_id, now, completed, completion_tokens):
        a = self.attempts.get(attempt_id)
        if a is not None and completed and a.first_token_at is not None and completion_tokens > 1:
            a.tpot = (now - a.first_token_at) / (completion_tokens - 1)
        return super().finished(attempt_id, now, completed, completion_tokens)


def _run(scenario_name: str, load: float, overrides: dict, replicas: int, duration_s: float, seed: int,
         profile: str, let_through: str | None = None, arrivals_until: float | None = None,
         no_expiry: bool = False) -> LoggingCorePolicy:
    scenario = get_scenario(scenario_name, duration_s)
    traces = scenario.load()
    capacity = fleet_capacity(scenario, traces, replicas, profile, seed, None)
    requests = make_requests(scenario.tenants, traces, load * capacity, duration_s, seed)
    if arrivals_until is not None:
        requests = [r for r in requests if r.arrival <= arrivals_until]
    cfg = fleet_config("bouncer", replicas, profile, seed, scenario)
    policy = {**BOUNCER_POLICY, **overrides}
    gw = LoggingCorePolicy("bouncer", core_config(tenant_configs(scenario), cfg.replicas, cfg.profile.num_blocks,
                                                  cfg.profile.block_size, cfg.profile.max_model_len, policy,
                                                  step_time=cfg.profile.step_time_config), let_through, no_expiry)
    FleetSim(cfg, gw, gw.replica_names).run(requests)
    return gw


def _errors(pairs: list[tuple[float, float]]) -> dict:
    """Relative error |predicted - observed| / observed, and the ratio of the means (bias)."""
    if not pairs:
        return {"n": 0}
    rel = sorted(abs(p - o) / o for p, o in pairs)
    return {"n": len(pairs),
            "median_abs_rel_error": round(statistics.median(rel), 4),
            "p90_abs_rel_error": round(rel[int(0.9 * (len(rel) - 1))], 4),
            "mean_predicted_over_mean_observed": round(sum(p for p, _ in pairs) / sum(o for _, o in pairs), 4)}


def predictor_error(attempts: dict[str, Attempt], skip_s: float = 0.0) -> dict:
    """Errors of the TTFT and TPOT predictions made at dispatch, for attempts dispatched after
    `skip_s` (the warm-up, while the online correction has seen little)."""
    ttft = [(a.predicted_ttft, a.first_token_at - a.dispatched_at) for a in attempts.values()
            if a.predicted_ttft is not None and a.first_token_at is not None and a.dispatched_at >= skip_s
            and a.first_token_at > a.dispatched_at]
    tpot = [(a.predicted_tpot, a.tpot) for a in attempts.values()
            if a.predicted_tpot is not None and a.tpot is not None and a.dispatched_at >= skip_s]
    return {"ttft": _errors(ttft), "tpot": _errors(tpot)}  # type: ignore[arg-type]


def _missed(a: Attempt) -> bool:
    return a.first_token_at is None or a.first_token_at - a.offered_at > a.ttft_slo  # type: ignore[operator]


def _in_time(gw: LoggingCorePolicy, until: float) -> int:
    return sum(1 for a in gw.attempts.values() if a.offered_at <= until and a.ttft_slo is not None and not _missed(a))


def _ms(values: list[float], q: float) -> float | None:
    return round(1e3 * values[int(q * (len(values) - 1))], 4) if values else None


def paired(scenario: str = "surge", load: float = 2.0, replicas: int = 2, duration_s: float = 120.0, seed: int = 0,
           samples: int = 30, profile: str = DEFAULT_PROFILE) -> dict:
    shipped = _run(scenario, load, {}, replicas, duration_s, seed, profile)
    # refused by their offer() call, at arrival (not queued requests found late at a later dispatch)
    refused = {aid: a for aid, a in shipped.attempts.items() if a.refused_at_arrival}
    offer_s = sorted(a.offer_s for a in refused.values())
    sample = sorted(random.Random(seed).sample(sorted(refused), min(samples, len(refused))))
    forks: dict[str, list[dict]] = {"admitted": [], "admitted_no_expiry": []}
    for aid in sample:
        a = refused[aid]
        for mode, runs in forks.items():
            fork = _run(scenario, load, {}, replicas, duration_s, seed, profile, let_through=aid,
                        arrivals_until=a.offered_at + a.ttft_slo, no_expiry=mode == "admitted_no_expiry")  # type: ignore[operator]
            f = fork.attempts[aid]
            assert f.offered_at == a.offered_at and not f.refused_infeasible, "the paired run diverged before it"
            ttft = None if f.first_token_at is None else round(f.first_token_at - f.offered_at, 3)
            cutoff = a.offered_at + a.ttft_slo  # type: ignore[operator]
            runs.append({"attempt": aid, "arrival_s": round(a.offered_at, 3), "ttft_slo_s": a.ttft_slo,
                         "ttft_s": ttft, "missed": _missed(f),
                         # attempts served in time, of those offered up to its deadline: did letting it
                         # through add one, or take the place of another?
                         "in_time_gained": _in_time(fork, cutoff) - _in_time(shipped, cutoff)})
    everything = _run(scenario, load, {"refuse_infeasible": False, "ttl_within_slo": False}, replicas,
                      duration_s, seed, profile)
    refused_here = [everything.attempts[aid] for aid, a in shipped.attempts.items()
                    if a.refused_infeasible and aid in everything.attempts]
    flagged = [a for a in everything.attempts.values() if a.flagged and a.ttft_slo is not None]
    unflagged = [a for a in everything.attempts.values() if not a.flagged and a.ttft_slo is not None]
    return {
        "scenario": scenario, "load": load, "replicas": replicas, "duration_s": duration_s, "seed": seed,
        "shipped": {
            "attempts": len(shipped.attempts),
            "refused_deadline_infeasible": sum(a.refused_infeasible for a in shipped.attempts.values()),
            "refused_at_arrival": len(refused),
            "offer_core_ms_p50": _ms(offer_s, 0.5),
            "offer_core_ms_p99": _ms(offer_s, 0.99),
            "offer_core_ms_p999": _ms(offer_s, 0.999),
            "offer_core_ms_max": _ms(offer_s, 1.0),
            "offer_core_under_1ms_fraction": round(sum(s < 1e-3 for s in offer_s) / len(offer_s), 5)
            if offer_s else None,
        },
        "refused_then_let_through": {mode: {
            "samples": len(runs),
            "missed": sum(f["missed"] for f in runs),
            "missed_fraction": round(sum(f["missed"] for f in runs) / len(runs), 4) if runs else None,
            "in_time_gained_mean": round(statistics.mean(f["in_time_gained"] for f in runs), 3) if runs else None,
            "runs": runs,
        } for mode, runs in forks.items()},
        "everything_admitted": {
            "attempts": len(everything.attempts),
            "refused_when_shipped": len(refused_here),
            "refused_when_shipped_missed_fraction": round(sum(map(_missed, refused_here)) / len(refused_here), 4)
            if refused_here else None,
            "flagged": len(flagged),
            "flagged_missed_fraction": round(sum(map(_missed, flagged)) / len(flagged), 4) if flagged else None,
            "unflagged": len(unflagged),
            "unflagged_missed_fraction": round(sum(map(_missed, unflagged)) / len(unflagged), 4)
            if unflagged else None,
        },
    }


def run(scenario: str = "surge", load: float = 2.0, steady_load: float = 0.7, replicas: int = 2,
        duration_s: float = 120.0, seed: int = 0, samples: int = 30, profile: str = DEFAULT_PROFILE) -> dict:
    """Both measurements: the predictor's error at a steady load, the paired runs at `load`."""
    t0 = time.perf_counter()
    steady = _run(scenario, steady_load, {}, replicas, duration_s, seed, profile)
    out = {"steady_load": steady_load,
           # the first 20 s: the online correction has seen little yet
           "predictor_error": predictor_error(steady.attempts, skip_s=20.0),
           **paired(scenario, load, replicas, duration_s, seed, samples, profile)}
    out["wall_seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(scenario: str, load: float, steady_load: float, replicas: int, duration_s: float, seed: int, samples: int,
         out: str | None) -> dict:
    from bouncer.bench.goodput import save

    r = run(scenario, load, steady_load, replicas, duration_s, seed, samples)
    if out:
        save(r, out)
    for kind, e in r["predictor_error"].items():
        if not e["n"]:
            print(f"{kind}: no requests dispatched after the 20 s warm-up")
            continue
        print(f"{kind} predicted at dispatch, load {r['steady_load']}: median error "
              f"{e['median_abs_rel_error']:.1%}, p90 {e['p90_abs_rel_error']:.1%}, mean predicted / mean observed "
              f"{e['mean_predicted_over_mean_observed']} ({e['n']} requests)")
    s = r["shipped"]
    print(f"{r['scenario']} at load {r['load']}: {s['refused_at_arrival']} refused at arrival as deadline_infeasible; "
          f"core time of those offers p50 {s['offer_core_ms_p50']} ms, p99 {s['offer_core_ms_p99']} ms, "
          f"p99.9 {s['offer_core_ms_p999']} ms, max {s['offer_core_ms_max']} ms")
    for mode, f in r["refused_then_let_through"].items():
        print(f"  let through ({mode}): {f['missed']} of {f['samples']} missed their TTFT SLO; "
              f"in-time attempts gained per one let through: {f['in_time_gained_mean']}")
    e = r["everything_admitted"]
    print(f"  everything admitted: {e['refused_when_shipped_missed_fraction']:.1%} of the "
          f"{e['refused_when_shipped']} attempts refused as shipped missed; {e['flagged_missed_fraction']:.1%} of "
          f"{e['flagged']} flagged missed, and {e['unflagged_missed_fraction']:.1%} of the {e['unflagged']} others")
    return r
