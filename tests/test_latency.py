"""Latency prediction and SLO feasibility: the step-time model, its online correction, refusing
or demoting requests that cannot meet their TTFT, and holding those that would push running
requests past their TPOT SLO."""

from __future__ import annotations

import pytest

from bouncer.bench import feasibility, goodput
from bouncer.config import parse_config
from bouncer.core.admission import AdmissionCore
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.learning import feedback, ttft_margin
from bouncer.core.learning.latency import CORRECTION_MAX, LatencyPredictor, prefill_pairs
from bouncer.core.learning.step_time import StepTimeModel
from bouncer.core.learning.ttft_margin import TtftMargins
from bouncer.core.outcomes import Terminal
from bouncer.sim.profiles import DEFAULT_PROFILE
from core_helpers import admission_of, dispatched, info, observe_idle, rejected, tenant

# 0.11 s per full step of 1,000 tokens; attention free unless a test says otherwise
STEP = {"a": 0.01, "b": 1e-4, "c": 0.0, "max_batched_tokens": 1000}


def core_with_steps(tenants, step=None, policy=None, replicas: int = 1) -> AdmissionCore:
    cfg = {
        "tenants": tenants,
        "models": [{"name": "m", "max_model_len": 32768, "block_size": 16, "step_time": step or STEP,
                    "backends": [{"url": f"http://127.0.0.1:{9000 + i}", "kv_blocks": 100_000}
                                 for i in range(replicas)]}],
        # these tests build long prefill queues on purpose: a replica is not full for that alone
        "policy": {"prefill_busy_tokens": 10**6, **(policy or {})},
    }
    core = AdmissionCore(parse_config(cfg), 0.0)
    observe_idle(core, 0.0)
    return core


def test_ttft_is_the_prefill_ahead_and_its_own_in_budget_sized_steps():
    p = LatencyPredictor(StepTimeModel(**STEP))
    # idle: one step of its own 100 tokens
    assert p.raw_ttft(0, 100, 0, 0) == pytest.approx(0.01 + 1e-4 * 100)
    # 1,500 ahead + its 500: two full steps of 1,000 tokens
    assert p.raw_ttft(1500, 500, 0, 0) == pytest.approx(2 * 0.11)
    # 200 decoding requests take 200 tokens of every step: 2,000 tokens of prefill need 3 steps
    assert p.raw_ttft(1500, 500, 200, 0) == pytest.approx(3 * 0.11)


def test_ttft_adds_prefill_attention_quadratic_in_the_prompt():
    assert prefill_pairs(10, 10) == 55  # 1 + 2 + ... + 10
    assert prefill_pairs(10, 3) == 8 + 9 + 10  # the last 3 tokens, after 7 cached
    p = LatencyPredictor(StepTimeModel(**STEP, d=1e-8))
    assert p.raw_ttft(0, 100, 0, 0, pairs=prefill_pairs(100, 100)) == pytest.approx(0.01 + 1e-4 * 100 + 1e-8 * 5050)
    # a replica counts the pairs of the prefill queued there, and its own on top
    core = core_with_steps([tenant("a")], step={**STEP, "d": 1e-8})
    r = core.replicas["m/0"]
    assert dispatched(core.offer(info(prompt=400), 0.0))
    assert r.queued_prefill_pairs == prefill_pairs(400, 400)
    adm = next(iter(core.permits))
    assert r.predict_ttft(adm, 50, raw=True) == pytest.approx(
        r.latency.raw_ttft(400, 50, 0, 0) + 1e-8 * (prefill_pairs(400, 400) + prefill_pairs(400, 50)))


def test_tpot_grows_with_the_batch_its_context_and_the_prefill_arriving():
    p = LatencyPredictor(StepTimeModel(a=0.01, b=1e-4, c=1e-6, max_batched_tokens=1000))
    assert p.raw_tpot(10, 20_000, now=0.0) == pytest.approx(0.01 + 1e-3 + 0.02)
    assert p.raw_tpot(20, 40_000, now=0.0) > p.raw_tpot(10, 20_000, now=0.0)
    # 5,000 prefill tokens a second: each step carries 5,000 x its own length of them
    for t in range(100):
        p.dispatched(500, t / 10)
    rate = p.prefill_rate(10.0)
    assert 3000 < rate < 5000  # a 10 s moving average, still catching up
    assert p.raw_tpot(10, 20_000, now=10.0) == pytest.approx(0.031 / (1 - 1e-4 * rate))


def test_corrections_move_towards_what_is_observed_and_are_bounded():
    p = LatencyPredictor(StepTimeModel(**STEP))
    for _ in range(200):
        p.observe_ttft(0.1, 0.2)  # twice as slow as the model says
        p.observe_tpot(0.02, 0.01)  # twice as fast
    assert p.ttft_factor == pytest.approx(2.0, rel=0.01)
    assert p.tpot_factor == pytest.approx(0.5, rel=0.01)
    assert p.ttft(0, 100, 0, 0) == pytest.approx(2.0 * p.raw_ttft(0, 100, 0, 0), rel=0.01)
    for _ in range(500):
        p.observe_ttft(0.1, 100.0)  # an outlier storm moves it only as far as the clamp
    assert p.ttft_factor == CORRECTION_MAX


def test_the_core_corrects_its_replica_predictor_from_observed_first_tokens_and_streams():
    core = core_with_steps([tenant("a")])
    r = core.replicas["m/0"]
    for i in range(100):
        now = float(i)
        observe_idle(core, now)
        (d,) = dispatched(core.offer(info("a", prompt=100, max_tokens=100), now))
        ttft = 3 * admission_of(core, d).ttft_raw  # the engine is 3x slower to first token than its model
        core.started(d.request_id, now + ttft)
        core.finished(d.request_id, now + ttft + 99 * admission_of(core, d).tpot_raw, Terminal.COMPLETED, 100)
    assert r.latency.ttft_factor == pytest.approx(3.0, rel=0.05)
    assert r.latency.tpot_factor == pytest.approx(1.0, rel=0.05)


def _fill_prefill_queue(core: AdmissionCore, tokens: int, now: float = 0.0) -> None:
    """Dispatch prompts from tenant b (no SLO) that have not produced a first token yet."""
    for _ in range(tokens // 5000):
        assert dispatched(core.offer(info("b", prompt=5000, max_tokens=100), now))


def test_a_request_no_replica_can_serve_within_its_ttft_is_refused_before_any_prefill():
    core = core_with_steps([tenant("a", slo={"ttft_s": 1.0}), tenant("b"), tenant("patient", slo={"ttft_s": 5.0})])
    _fill_prefill_queue(core, 15_000)
    # 15,100 tokens of prefill at 1,000 per 0.11 s step: 16 steps, 1.76 s
    (r,) = core.offer(info("a", prompt=100), 0.0)
    assert (r.refusal.status, r.refusal.layer.value, r.refusal.reason) == (429, "slo", "deadline_infeasible")
    assert r.terminal is Terminal.REFUSED
    assert r.refusal.retry_after == pytest.approx(0.76, abs=0.01)  # once that much of the work has drained
    assert core.replicas["m/0"].queued_prefill_tokens == 15_000  # nothing of it was sent
    assert dispatched(core.offer(info("patient", prompt=100), 0.0))  # a 5 s SLO fits


@pytest.mark.parametrize("refuse", [True, False])
def test_only_replicas_that_can_still_make_the_deadline_qualify(refuse):
    core = core_with_steps([tenant("a", slo={"ttft_s": 1.0}), tenant("b")], replicas=2,
                           policy={"routing": {"router": "round-robin"}, "refuse_infeasible": refuse})
    # round-robin alternates: three 5,000-token prompts wait on one replica, the other's started
    for _ in range(6):
        (d,) = dispatched(core.offer(info("b", prompt=5000, max_tokens=100), 0.0))
        if d.replica == "m/1":
            core.started(d.request_id, 0.0)
    assert (core.replicas["m/0"].queued_prefill_tokens, core.replicas["m/1"].queued_prefill_tokens) == (15_000, 0)
    # it is m/0's turn, where this request would wait 1.76 s for a 1 s TTFT SLO; m/1 can make it
    # (with refusal off too: that only governs requests no replica can serve in time)
    (d,) = dispatched(core.offer(info("a", prompt=100), 0.0))
    assert d.replica == "m/1" and not d.predicted_late


def test_a_best_effort_tenant_is_demoted_instead_of_refused():
    core = core_with_steps([tenant("a", slo={"ttft_s": 1.0, "on_infeasible": "best-effort"}), tenant("b")])
    _fill_prefill_queue(core, 15_000)
    req = info("a", prompt=100)
    assert core.offer(req, 0.0) == []  # neither refused nor sent yet: moved to the best-effort band
    adm = core.models["m"].flow.get(req.request_id)
    assert (adm.priority, adm.best_effort, adm.ttft_deadline) == (-1, True, None)
    assert adm.deadline == pytest.approx(30.0)  # the TTL is no longer cut to the SLO
    # behind band 0, which still sends: it waits while that prefill queue would delay band 0's next
    assert core.tick(0.01) == []
    for rid in core.view.inflight_ids():
        core.started(rid, 0.5)
    (d,) = dispatched(core.tick(0.5))
    assert d.request_id == req.request_id


def test_with_refusal_off_infeasible_requests_are_only_flagged():
    core = core_with_steps([tenant("a", slo={"ttft_s": 1.0}), tenant("b")], policy={"refuse_infeasible": False})
    _fill_prefill_queue(core, 15_000)
    (d,) = dispatched(core.offer(info("a", prompt=100), 0.0))
    assert d.predicted_late


def test_a_queued_request_leaves_at_its_latest_start_time():
    core = core_with_steps([tenant("a", slo={"ttft_s": 2.0})])
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.99, running=50, waiting=0), 0.0)  # full: it must wait
    req = info("a", prompt=100)
    assert core.offer(req, 0.0) == []
    # its TTFT once sent is one step of 100 tokens (0.02 s); with room for twice that
    # (ttft_safety_factor), it can start as late as 1.96 s
    assert core.next_wakeup() == pytest.approx(2.0 - 2 * 0.02)
    (r,) = rejected(core.tick(1.97))
    assert (r.request_id, r.terminal) == (req.request_id, Terminal.EXPIRED)


def test_tpot_hold_keeps_the_batch_within_the_strictest_tpot_slo_running_there():
    step = {"a": 0.01, "b": 0.0, "c": 1e-6, "max_batched_tokens": 8192}
    tenants = [tenant("a", slo={"tpot_s": 0.05})]
    policy = {"prefill_busy_tokens": 10**6}
    core = core_with_steps(tenants, step, policy)
    # each request reads 4,000 + 256 / 2 tokens of context per step: 4.1 ms of a step each. With
    # 0.01 s fixed, 8 fit under the guarded 0.045 s (0.05 x tpot_guard_margin 0.9), a 9th does not.
    sent = [dispatched(core.offer(info("a", prompt=4000, max_tokens=256), 0.0)) for _ in range(9)]
    assert [len(s) for s in sent] == [1] * 8 + [0]
    assert core.replicas["m/0"].predict_tpot(admission_of(core, sent[0][0]), 0.0) > 0.045
    first = sent[0][0].request_id
    core.started(first, 0.1)
    # (telemetry here must stay fresh: a stale replica takes nothing)
    (d,) = dispatched(core.finished(first, 1.0, Terminal.COMPLETED, 256))  # room again: the 9th goes
    assert d.request_id not in {s[0].request_id for s in sent[:8]}
    # without the hold all nine go at once
    unguarded = core_with_steps(tenants, step, {**policy, "tpot_hold": False})
    assert all(dispatched(unguarded.offer(info("a", prompt=4000, max_tokens=256), 0.0)) for _ in range(9))


def test_lower_bands_leave_room_in_the_batch_while_a_higher_band_is_sending():
    # the same steps as above: each request adds 4.1 ms to a step of 0.01 s fixed
    step = {"a": 0.01, "b": 0.0, "c": 1e-6, "max_batched_tokens": 8192}
    tenants = [tenant("rt", 10, slo={"tpot_s": 0.05}), tenant("std", slo={"tpot_s": 0.15})]
    core = core_with_steps(tenants, step, {"prefill_busy_tokens": 10**6, "tpot_reserve_fraction": 0.3})
    (d,) = dispatched(core.offer(info("rt", prompt=4000, max_tokens=256), 0.0))
    core.started(d.request_id, 0.05)
    # while the realtime band sends, the standard band fills batches only to 0.05 x 0.9 x 0.7 =
    # 31.5 ms: 5 requests in all (30.5 ms), not the 8 the realtime TPOT target allows
    sent = [dispatched(core.offer(info("std", prompt=4000, max_tokens=256), 0.1)) for _ in range(5)]
    assert [len(x) for x in sent] == [1, 1, 1, 1, 0]
    # the realtime band itself may still join, up to its own target
    assert all(dispatched(core.offer(info("rt", prompt=4000, max_tokens=256), 0.1)) for _ in range(3))
    # without the reserve the standard band fills the batch to the realtime target
    core = core_with_steps(tenants, step, {"prefill_busy_tokens": 10**6, "tpot_reserve_fraction": 0.0})
    (d,) = dispatched(core.offer(info("rt", prompt=4000, max_tokens=256), 0.0))
    core.started(d.request_id, 0.05)
    assert sum(len(dispatched(core.offer(info("std", prompt=4000, max_tokens=256), 0.1))) for _ in range(9)) == 7


def test_without_a_step_time_model_nothing_is_predicted():
    cfg = {"tenants": [tenant("a", slo={"ttft_s": 1.0})],
           "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9000", "kv_blocks": 1000}]}]}
    core = AdmissionCore(parse_config(cfg), 0.0)
    observe_idle(core, 0.0)
    (d,) = dispatched(core.offer(info("a"), 0.0))
    assert core.replicas["m/0"].latency is None and admission_of(core, d).ttft_raw is None


@pytest.fixture
def capacity_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(goodput, "CACHE_DIR", tmp_path / "capacity")


def test_predictions_on_the_engine_model_are_within_20_percent_at_steady_load(capacity_cache):
    gw = feasibility._run("surge", 0.7, {}, 2, 60.0, 0, DEFAULT_PROFILE)
    err = feasibility.predictor_error(gw.attempts, skip_s=20.0)
    for kind in ("ttft", "tpot"):
        e = err[kind]
        assert e["n"] > 500, kind
        assert e["median_abs_rel_error"] <= 0.20, (kind, e)
        assert 0.8 <= e["mean_predicted_over_mean_observed"] <= 1.2, (kind, e)


def test_a_paired_run_is_the_same_run_until_the_request_it_lets_through(capacity_cache):
    r = feasibility.paired("surge", 3.0, replicas=1, duration_s=20.0, samples=2)
    assert r["shipped"]["refused_at_arrival"] > 0
    assert r["shipped"]["offer_core_ms_p50"] < 1.0
    for mode in ("admitted", "admitted_no_expiry"):
        runs = r["refused_then_let_through"][mode]["runs"]
        assert len(runs) == 2
        # (paired() asserts each let-through attempt arrived at the same instant and was not refused)
        assert all(x["missed"] == (x["ttft_s"] is None or x["ttft_s"] > x["ttft_slo_s"]) for x in runs)


def test_lower_bands_keep_the_prefill_queue_short_while_a_higher_band_is_sending():
    core = core_with_steps([tenant("rt", 10, slo={"ttft_s": 0.5}), tenant("std")],
                           policy={"prefill_busy_tokens": 10**6})
    (d,) = dispatched(core.offer(info("rt", prompt=10), 0.0))
    core.started(d.request_id, 0.05)
    # 900 queued prefill tokens: a realtime request would start after one step (0.1 s), within a
    # quarter of its 0.5 s SLO (ttft_reserve_fraction); 1,800 would take two steps (0.22 s)
    assert dispatched(core.offer(info("std", prompt=900), 0.1))
    held = info("std", prompt=900)
    assert core.offer(held, 0.1) == []
    assert dispatched(observe_idle(core, 9.0) + core.tick(9.0)) == []
    # ten seconds without a realtime request: the reserve lifts (at the next scrape)
    (d,) = dispatched(observe_idle(core, 10.2))
    assert d.request_id == held.request_id


def test_the_tpot_guard_cuts_a_replica_for_requests_slower_than_their_own_tpot_slo():
    core = core_with_steps([tenant("rt", 10, slo={"tpot_s": 0.05}), tenant("std", slo={"tpot_s": 0.15})])
    r = core.replicas["m/0"]

    def complete(name: str, tpot: float, now: float) -> None:
        (d,) = dispatched(core.offer(info(name, prompt=10, max_tokens=101), now))
        core.started(d.request_id, now)
        core.finished(d.request_id, now + 100 * tpot, Terminal.COMPLETED, 101)

    complete("std", 0.10, 0.0)  # slower than realtime's SLO, within its own: no cut
    assert r.concurrency_limit == float("inf")
    complete("rt", 0.06, 0.5)  # slower than its own 50 ms (x 0.9): cut
    assert r.concurrency_limit == core.policy.min_inflight_per_replica
    assert r.prefill_limit == float("inf")  # 101 tokens: slow over many steps, not one long step


def test_a_short_answer_slower_than_its_tpot_slo_cuts_the_prefill_a_replica_takes_not_its_batch():
    core = core_with_steps([tenant("a", slo={"tpot_s": 0.3})])
    r = core.replicas["m/0"]
    (d,) = dispatched(core.offer(info("a", prompt=10, max_tokens=4), 0.0))
    core.started(d.request_id, 0.0)
    core.finished(d.request_id, 3 * 0.4, Terminal.COMPLETED, 4)  # 0.4 s a token: past 0.3 s (x 0.9)
    # a step of at most 0.3 s batches (0.3 - 0.01) / 1e-4 = 2,900 tokens, nothing decoding there
    assert r.prefill_limit == pytest.approx(2900)
    assert r.concurrency_limit == float("inf")
    # /admin/state shows it
    assert core.snapshot(1.2)["models"]["m"]["replicas"]["m/0"]["limits"] == {"inflight": None, "prefill_tokens": 2900}
    # 2,000 prefill tokens queued there: 1,000 more would pass the limit and wait, 800 fit
    (big,) = dispatched(core.offer(info("a", prompt=2000), 2.0))
    held = info("a", prompt=1000)
    assert core.offer(held, 2.0) == []
    core.started(big.request_id, 2.2)  # its prefill is done: the held one goes
    (d,) = dispatched(core.tick(2.2))
    assert d.request_id == held.request_id
    # a fast short answer: the limit grows back, by PREFILL_LIMIT_INCREASE tokens
    (d,) = dispatched(core.offer(info("a", prompt=10, max_tokens=4), 3.0))
    core.started(d.request_id, 3.0)
    core.finished(d.request_id, 3.3, Terminal.COMPLETED, 4)
    assert r.prefill_limit == pytest.approx(2900 + feedback.PREFILL_LIMIT_INCREASE)


def test_a_request_warm_on_a_replica_passes_the_tpot_guards_limit_a_cold_one_waits():
    core = core_with_steps([tenant("a"), tenant("b")])
    r = core.replicas["m/0"]
    prefix = list(range(1, 33))  # 32 blocks of 16 tokens
    assert dispatched(core.offer(info("a", prompt=512, block_digests=prefix), 0.0))
    r.concurrency_limit = 1  # as if the guard had cut it: one in flight already
    cold = info("b", prompt=512, block_digests=list(range(100, 132)))
    assert core.offer(cold, 0.1) == []
    (d,) = dispatched(core.offer(info("a", prompt=600, block_digests=prefix), 0.1))
    assert admission_of(core, d).prefill_tokens == 600 - 512  # only what it does not share is computed


def test_a_warm_request_is_not_turned_away_by_the_busy_marks_hysteresis():
    # (saturation read from KV alone, so that it does not stop dispatch first)
    core = core_with_steps([tenant("a"), tenant("b")], policy={"saturation": {"kv_threshold": 1.0}})
    prefix = list(range(1, 33))
    assert dispatched(core.offer(info("a", prompt=512, block_digests=prefix), 0.0))
    core.observe("m/0", Telemetry(at=0.1, kv_usage=0.95, running=1, waiting=0), 0.1)
    cold = info("b", prompt=512, block_digests=list(range(100, 132)))
    assert core.offer(cold, 0.1) == []  # marked busy at 95%
    # back to 88%: still busy until 85% (hysteresis), so the cold request keeps waiting ...
    assert dispatched(core.observe("m/0", Telemetry(at=0.2, kv_usage=0.88, running=1, waiting=0), 0.2)) == []
    # ... but one that shares the cached prefix needs only a few new blocks, and fits under 92%
    (d,) = dispatched(core.offer(info("a", prompt=600, block_digests=prefix), 0.2))
    assert admission_of(core, d).prefill_tokens == 600 - 512


def test_bench_feasibility_command_saves_what_it_prints(tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "f.json"
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "feasibility", "--duration", "20", "--replicas",
                           "1", "--samples", "1", "--load", "3", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "BOUNCER_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["shipped"]["refused_at_arrival"] > 0 and f"{r['shipped']['refused_at_arrival']} refused" in proc.stdout
    assert set(r["refused_then_let_through"]) == {"admitted", "admitted_no_expiry"}


def test_a_bands_ttft_margin_is_the_quantile_of_its_observed_error():
    m = TtftMargins()
    for _ in range(ttft_margin.MIN_OBSERVATIONS - 1):
        m.observe(1, 0.1, 0.1)
    assert m.margin(1) is None  # too few first tokens to say
    m.observe(1, 0.1, 0.1)
    assert m.margin(1) == 1.0  # exact predictions: no margin (and never below 1)
    for i in range(ttft_margin.WINDOW):  # one in five first tokens 50% late: the 90th percentile
        m.observe(1, 0.1, 0.15 if i % 5 == 0 else 0.1)
    assert m.margin(1) == pytest.approx(1.5)
    assert m.margin(0) is None  # per band
    for _ in range(ttft_margin.WINDOW):
        m.observe(0, 0.1, 10.0)
    assert m.margin(0) == ttft_margin.MAX_MARGIN


def _band_margin(core, band: int, margin: float) -> None:
    for _ in range(ttft_margin.MIN_OBSERVATIONS):
        core.models["m"].ttft_margins.observe(band, 0.1, 0.1 * margin)


def test_first_tokens_measure_their_bands_margin_against_the_prediction_decided_by():
    core = core_with_steps([tenant("a", slo={"ttft_s": 2.0})])
    (d,) = dispatched(core.offer(info("a", prompt=100), 0.0))
    core.started(d.request_id, d.predicted_ttft_s * 1.5)
    margins = core.models["m"].ttft_margins
    assert margins.snapshot() == {0: {"margin": None, "observed": 1}}
    assert margins._bands[0].ratios[0] == pytest.approx(1.5)
    assert core.snapshot(1.0)["models"]["m"]["ttft_margins"] == {0: {"margin": None, "observed": 1}}


def test_a_measured_margin_replaces_the_fixed_factor_in_the_queue_budget():
    core = core_with_steps([tenant("a", slo={"ttft_s": 2.0})])
    _band_margin(core, 0, 1.25)
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.99, running=50, waiting=0), 0.0)  # full: it must wait
    core.offer(info("a", prompt=100), 0.0)
    # its TTFT once sent is one step of 100 tokens (0.02 s): it may wait while 2 s leave room for
    # that x its band's margin, 1.25 (not x ttft_safety_factor, 2)
    assert core.next_wakeup() == pytest.approx(2.0 - 1.25 * 0.02)


def test_a_measured_margin_refuses_at_arrival_what_it_would_make_late():
    def queued_behind_prefill(margin: float) -> list:
        core = core_with_steps([tenant("a", slo={"ttft_s": 1.0}), tenant("b")])
        _fill_prefill_queue(core, 5_000)
        _band_margin(core, 0, margin)
        core.observe("m/0", Telemetry(at=0.0, kv_usage=0.99, running=50, waiting=0), 0.0)  # full: it must wait
        return core.offer(info("a", prompt=100), 0.0)

    # 5,100 tokens of prefill at 1,000 per 0.11 s step once sent: 0.66 s of its 1 s SLO. With its
    # band's first tokens up to 1.25x their predictions it may wait; up to 2x, it is refused now
    assert queued_behind_prefill(1.25) == []
    (r,) = rejected(queued_behind_prefill(2.0))
    assert r.refusal.reason == "deadline_infeasible"
