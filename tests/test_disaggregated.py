"""Disaggregated fleets: prefill and decode workers in the engine model and the fleet simulator,
the core's decode ledger and admission per role, and the `disaggregated` scenario."""

from __future__ import annotations

import pytest

from bouncer.bench.goodput import make_policy, run
from bouncer.config import ConfigError, parse_config
from bouncer.core.fleet.decode_room import DecodeLedger, choose_decode
from bouncer.core.fleet.replica import ReplicaState, Telemetry
from bouncer.core.outcomes import Terminal
from bouncer.sim.engine import EngineModel, EngineRequest
from bouncer.sim.fleet import FleetConfig, FleetSim, SimRequest
from bouncer.sim.pd_policies import PdRoundRobin
from bouncer.sim.profiles import get_profile
from bouncer.sim.scenarios import get_scenario
from core_helpers import dispatched, info, make_config, tenant

PROFILE = get_profile("llama-3.1-8b-h100")


# -- the engine model: KV handed over by a prefill worker -------------------------------------------
def test_decode_engine_takes_handed_over_kv_as_computed():
    engine = EngineModel(PROFILE, num_blocks=1000)
    req = EngineRequest("a", 4000, 5, [], 0.0, remote_tokens=4000)
    engine.add_request(req)
    step = engine.step(0.0)
    # one token computed (the last of the prompt), and the first output token sampled
    assert step.batched_tokens == 1
    assert step.started == [req]
    assert engine.counters.kv_transfer_tokens == 3999
    assert len(req.blocks) == 4000 // PROFILE.block_size  # the blocks of the computed tokens


def test_preempted_decode_request_recomputes_its_prompt():
    engine = EngineModel(PROFILE, num_blocks=1000)
    req = EngineRequest("a", 4000, 50, [], 0.0, remote_tokens=4000)
    engine.add_request(req)
    engine.step(0.0)
    engine._preempt(engine.running.pop())
    assert req.remote_tokens == 0  # its KV is gone: the decode worker computes the prompt itself
    step = engine.step(1.0)
    assert step.batched_tokens == min(4001, PROFILE.max_num_batched_tokens)


# -- the fleet simulator -----------------------------------------------------------------------------
def _pd_fleet(prefill: int = 1, decode: int = 1, **kw) -> FleetConfig:
    return FleetConfig(replicas=prefill, decode_replicas=decode, profile=PROFILE, **kw)


def _requests(n: int, prompt: int = 2000, output: int = 50, gap: float = 0.05, timeout: float = 60.0):
    return [SimRequest(f"q{i}", "t", 0, i * gap, prompt, output, output, [], None, None, timeout, 0)
            for i in range(n)]


def test_pd_fleet_serves_every_request_with_the_transfer_in_its_ttft():
    cfg = _pd_fleet(2, 2)
    policy = PdRoundRobin(cfg.roles())
    reqs = _requests(20)
    result = FleetSim(cfg, policy, policy.replica_names).run(reqs)
    assert result.lost == 0 and result.outcomes["completed"] == 20
    prefill_alone = PROFILE.step_time(2000, 2000, 0)  # one chunk: the prompt
    for r in reqs:
        assert r.first_token_at - r.arrival >= prefill_alone + PROFILE.kv_transfer_s(2000)
    sim = FleetSim(cfg, PdRoundRobin(cfg.roles()), cfg.roles())
    sim.run(_requests(20))
    decode = [e.counters for name, e in sim.engines.items() if name.startswith("d")]
    prefill = [e.counters for name, e in sim.engines.items() if name.startswith("p")]
    assert sum(c.kv_transfer_tokens for c in decode) == 20 * 1999
    assert sum(c.generation_tokens for c in prefill) == 20  # one token each, discarded
    assert sum(c.generation_tokens for c in decode) == 20 * 50


def test_decode_worker_refusal_counts_as_refused_after_prefill():
    cfg = _pd_fleet(1, 1, max_num_queued_reqs=2)
    policy = PdRoundRobin(cfg.roles())
    result = FleetSim(cfg, policy, policy.replica_names).run(_requests(30, output=400, gap=0.01))
    assert result.lost == 0
    assert result.refused_after_prefill > 0
    assert result.refused_by_reason["engine/max_num_queued_reqs"] >= result.refused_after_prefill


def test_timeout_while_kv_is_in_transit_is_abandoned_not_lost():
    slow_link = _pd_fleet(1, 1)
    slow_link.profile = PROFILE.__class__(**{**{f: getattr(PROFILE, f) for f in PROFILE.__dataclass_fields__},
                                             "transfer_setup_s": 5.0})
    policy = PdRoundRobin(slow_link.roles())
    reqs = _requests(3, timeout=2.0)
    result = FleetSim(slow_link, policy, policy.replica_names).run(reqs)
    assert result.lost == 0
    assert {r.outcome for r in reqs} == {"abandoned"}
    assert all(r.wasted_tokens >= 2000 for r in reqs)


def test_fleet_refuses_a_policy_that_sends_prefill_without_a_decode_worker():
    cfg = _pd_fleet(1, 1)

    class Wrong(PdRoundRobin):
        def offer(self, req, now):
            from bouncer.sim.fleet import Dispatched
            return [Dispatched(req.attempt_id, "p0")]

    with pytest.raises(ValueError, match="prefill engine p0"):
        FleetSim(cfg, Wrong(cfg.roles()), list(cfg.roles())).run(_requests(1))


# -- the decode ledger ---------------------------------------------------------------------------------
def test_ledger_peak_counts_growth_arrivals_and_ends():
    ledger = DecodeLedger()
    ledger.tpot_s, ledger.handoff_s = 0.01, 0.0
    ledger.bind("a", prompt=1000, output=100, arrive_at=0.0)  # 0..1 s, 1000 -> 1100 tokens
    ledger.bind("b", prompt=500, output=300, arrive_at=0.5)  # 0.5..3.5 s, 500 -> 800
    assert ledger.peak(0.0, 0.4, now=0.0) == pytest.approx(1040)
    # just before a ends (t=1): 1100 + 550
    assert ledger.peak(0.0, 2.0, now=0.0) == pytest.approx(1650)
    assert ledger.peak(1.5, 2.0, now=0.0) == pytest.approx(650)
    ledger.release("a")
    assert ledger.peak(0.0, 0.4, now=0.0) == 0


def test_ledger_overdue_request_runs_as_long_again_and_learns_speed():
    ledger = DecodeLedger()
    ledger.tpot_s, ledger.handoff_s = 0.01, 0.0
    ledger.bind("a", prompt=1000, output=100, arrive_at=0.0)
    ledger.arrived("a", 0.0)
    ledger.first_token("a", 0.0)
    # predicted to end at 0.99 s; at now=5 s it still runs: held until about 6 s, and grown
    assert ledger.peak(5.5, 5.6, now=5.0) > 1100
    assert ledger.peak(7.0, 8.0, now=5.0) == 0
    ledger.observe_tpot(0.05)
    assert ledger.tpot_s == pytest.approx(0.01 + 0.1 * 0.04)


def test_ledger_peak_is_the_most_held_at_any_instant_on_random_ledgers():
    """Against the definition, summed directly: what is held at `start`, just before each end
    inside the span, and just before `end` (between those instants it only grows)."""
    import random
    rng = random.Random(7)
    for _ in range(200):
        ledger = DecodeLedger()
        ledger.tpot_s, ledger.handoff_s = rng.choice([0.01, 0.02, 0.05]), 0.0
        now = 10.0
        for i in range(rng.randint(0, 30)):
            arrive = rng.choice([now - 20, now]) + rng.uniform(0, 15)
            ledger.bind(f"r{i}", rng.randint(1, 4000), rng.randint(1, 500), arrive)
        spans = [(b.start, b.end if b.end > now else now + b.output * ledger.tpot_s, b.prompt)
                 for b in ledger._bound.values()]
        rate = 1 / ledger.tpot_s

        def at(t, before, spans=spans, rate=rate):
            return sum(p + (t - s) * rate for s, e, p in spans if (s < t <= e if before else s <= t < e))
        a = rng.uniform(0, 30)
        b = a + rng.uniform(0.1, 20)
        expected = max([at(a, False), at(b, True)] + [at(e, True) for _, e, _ in spans if a < e < b])
        assert ledger.peak(a, b, now) == pytest.approx(expected, rel=1e-9, abs=1e-6)
        # with a limit the sweep may stop at a bound: one over the limit says the peak is too
        limit = rng.uniform(0, 2 * expected + 1)
        bounded = ledger.peak(a, b, now, limit)
        assert (bounded > limit) == (expected > limit + 1e-6) or abs(expected - limit) < 1e-6
        if bounded <= limit:
            assert bounded >= expected - 1e-6


def _decode_worker(name: str, blocks: int) -> ReplicaState:
    r = ReplicaState(name, "m", None, blocks, 16)
    r.role = "decode"
    r.decode_ledger = DecodeLedger()
    return r


def test_choose_decode_takes_the_emptiest_and_waits_when_none_has_room():
    full, roomy = _decode_worker("d0", 100), _decode_worker("d1", 100)  # 1,600 tokens each
    full.decode_ledger.bind("x", prompt=1400, output=50, arrive_at=0.0)
    assert choose_decode([full, roomy], 500, 50, 16, 0.1, 0.92, 0.0) is roomy
    roomy.decode_ledger.bind("y", prompt=1200, output=50, arrive_at=0.0)
    assert choose_decode([full, roomy], 500, 50, 16, 0.1, 0.92, 0.0) is None
    # once they are predicted gone, the same request fits
    assert choose_decode([full, roomy], 500, 50, 16, 60.0, 0.92, 0.0) is not None


# -- the core: admission per role ------------------------------------------------------------------------
def _pd_config(decode_blocks: int = 1000, **kw) -> dict:
    cfg = make_config(tenants=[tenant("a")], **kw)
    cfg["models"][0]["backends"] = [
        {"url": "http://127.0.0.1:9000", "name": "p0", "kv_blocks": 1000, "role": "prefill"},
        {"url": "http://127.0.0.1:9001", "name": "d0", "kv_blocks": decode_blocks, "role": "decode"},
    ]
    return cfg


def _pd_core(now: float = 0.0, **kw):
    from bouncer.core.admission import AdmissionCore
    core = AdmissionCore(parse_config(_pd_config(**kw)), now)
    for name in core.replicas:
        core.observe(name, Telemetry(at=now, kv_usage=0.0, running=0, waiting=0), now)
    return core


def test_config_rejects_colocated_and_disaggregated_backends_mixed():
    cfg = _pd_config()
    cfg["models"][0]["backends"][1]["role"] = "both"
    with pytest.raises(ConfigError, match="either all role `both`"):
        parse_config(cfg)
    cfg["models"][0]["backends"][1]["role"] = "prefill"
    with pytest.raises(ConfigError, match="at least one of each"):
        parse_config(cfg)


def test_core_dispatches_to_a_prefill_worker_naming_the_decode_worker_and_hands_over():
    core = _pd_core()
    (d,) = dispatched(core.offer(info(prompt=1600, max_tokens=64), 0.0))
    assert (d.replica, d.decode_replica) == ("p0", "d0")
    prefill, decode = core.replicas["p0"], core.replicas["d0"]
    assert len(prefill.inflight) == 1 and prefill.inflight_blocks == 100  # the prompt only
    assert len(decode.decode_ledger) == 1 and not decode.inflight
    core.handed_over(d.request_id, 0.5)
    assert not prefill.inflight and prefill.queued_prefill_tokens == 0
    assert len(decode.inflight) == 1 and decode.inflight_blocks == -(-(1600 + 64) // 16)
    core.started(d.request_id, 0.6)
    core.finished(d.request_id, 2.0, Terminal.COMPLETED, 64)
    assert not decode.inflight and len(decode.decode_ledger) == 0
    assert decode.decode_ledger.tpot_s != pytest.approx(0.03)  # learned from the completion


def test_core_holds_a_request_until_the_decode_worker_has_room_then_sends_it():
    core = _pd_core(decode_blocks=200)  # 3,200 tokens of decode KV
    (first,) = dispatched(core.offer(info(prompt=2500, max_tokens=64), 0.0))
    held = core.offer(info(prompt=2500, max_tokens=64), 0.0)
    assert not dispatched(held) and not [e for e in held if e.__class__.__name__ == "Reject"]
    assert core.view.queued == 1
    core.handed_over(first.request_id, 0.3)
    core.started(first.request_id, 0.35)
    events = core.finished(first.request_id, 1.0, Terminal.COMPLETED, 64)
    (second,) = dispatched(events)
    assert second.decode_replica == "d0"


def test_a_decode_worker_refusal_takes_the_request_back_and_frees_its_ledger_entry():
    core = _pd_core()
    (d,) = dispatched(core.offer(info(prompt=1600, max_tokens=64), 0.0))
    core.handed_over(d.request_id, 0.5)
    again = dispatched(core.requeue(d.request_id, 0.6))
    decode = core.replicas["d0"]
    # held again, or sent again: either way the ledger counts it once, as the permits do
    assert len(decode.decode_ledger) == len(again) == len(core.permits)
    if not again:
        assert not decode.inflight and not core.replicas["p0"].inflight


# -- the scenario ---------------------------------------------------------------------------------------
def test_disaggregated_scenario_splits_the_fleet_by_the_mix():
    scenario = get_scenario("disaggregated", 60)
    prefill, decode = scenario.pd_split(PROFILE, 8)
    assert prefill + decode == 8 and prefill >= 1 and decode >= 1
    with pytest.raises(ValueError, match="at least 2 engines"):
        scenario.pd_split(PROFILE, 1)


def test_bouncer_on_the_disaggregated_scenario_refuses_nothing_after_prefill():
    out = run("disaggregated", "bouncer", 2.0, replicas=4, duration_s=30)
    assert out["lost"] == 0
    assert out["refused_after_prefill"] == 0
    assert out["decode_kv"] is not None and out["decode_kv"]["mean"] > 0
    assert out["outcomes"]["completed"] > 0


def test_policies_not_modelled_on_two_pools_say_so():
    scenario = get_scenario("disaggregated", 60)
    cfg = FleetConfig(replicas=2, decode_replicas=2, profile=PROFILE)
    with pytest.raises(ValueError, match="not modelled on a disaggregated fleet"):
        make_policy("tgi-cap", scenario, cfg)
    with pytest.raises(ValueError, match="not modelled on a disaggregated fleet"):
        make_policy("llmd-flow-control", scenario, cfg)


def test_report_shows_the_decode_pool(tmp_path):
    from bouncer.bench.goodput import save
    from bouncer.bench.report import write_report
    for policy in ("pd-current-load", "bouncer"):
        save(run("disaggregated", policy, 2.0, replicas=4, duration_s=30), str(tmp_path / f"{policy}.json"))
    report = write_report([str(tmp_path)], str(tmp_path / "report")).read_text()
    assert "| policy | load | refused after prefill | decode KV mean |" in report
    assert "| bouncer | 2 | 0 |" in report
    assert (tmp_path / "report" / "decode-pool-disaggregated.png").stat().st_size > 0
