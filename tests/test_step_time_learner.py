"""The learned step time (bouncer/core/learning/step_time_learner.py): it finds an engine's coefficients
from the observations the gateway makes, stays silent until it has seen enough, keeps the prior
where the traffic says nothing, and is not thrown by requests that waited for other reasons."""

from __future__ import annotations

import random

import pytest

from bouncer.config import parse_config
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.learning.latency import LatencyPredictor, prefill_pairs
from bouncer.core.learning.step_time import StepTimeModel
from bouncer.core.learning.step_time_learner import GENERIC_PRIOR, StepTimeLearner, decode_terms
from bouncer.core.outcomes import Terminal
from core_helpers import dispatched, info, make_config, make_core, observe_idle, tenant

TRUE = StepTimeModel(a=0.006, b=3e-5, c=4e-8, max_batched_tokens=8192, d=9e-10, e=0.004)
TRUE_TERMS = (TRUE.a, TRUE.b, TRUE.c, TRUE.d, TRUE.e)


def _ttft(rng: random.Random, learner: StepTimeLearner, truth: StepTimeModel = TRUE, noise: float = 0.0):
    """One first token at a random load, timed by `truth`."""
    predictor = LatencyPredictor(learner=learner)
    prompt = rng.choice([64, 300, 2000, 6000, 30000])
    ahead, decoding, ctx = rng.randint(0, 20000), rng.randint(0, 200), rng.randint(0, 300000)
    pairs = prefill_pairs(prompt, prompt)
    terms = predictor.ttft_terms(ahead, prompt, decoding, ctx, pairs)
    observed = sum(t * c for t, c in zip(terms, (truth.a, truth.b, truth.c, truth.d, truth.e), strict=True))
    return terms, observed * (1 + rng.uniform(-noise, noise))


def _tpot(rng: random.Random, truth: StepTimeModel = TRUE):
    batch, ctx, rate = rng.randint(1, 256), rng.randint(100, 400000), rng.uniform(0, 20000)
    step = (truth.a + truth.b * batch + truth.c * ctx) / (1 - truth.b * rate)  # s = a + b (n + p s) + c ctx
    return batch, ctx, rate, step


def _feed(learner: StepTimeLearner, n: int, seed: int = 0, noise: float = 0.0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        learner.observe_ttft(*_ttft(rng, learner, noise=noise))
        learner.observe_tpot(*_tpot(rng))


def test_it_finds_the_engines_coefficients_from_first_tokens_and_decode_steps():
    learner = StepTimeLearner(GENERIC_PRIOR, 8192)
    _feed(learner, 300, noise=0.05)
    m = learner.model
    for got, true in zip((m.a, m.b, m.c, m.d), TRUE_TERMS[:4], strict=True):
        assert got == pytest.approx(true, rel=0.1)
    assert m.e == pytest.approx(TRUE.e, rel=0.25)  # a few ms of every TTFT: the least of what each shows


def test_it_predicts_nothing_until_it_has_seen_enough():
    learner = StepTimeLearner(GENERIC_PRIOR, 8192)
    predictor = LatencyPredictor(learner=learner)
    rng = random.Random(1)
    for _ in range(7):  # first tokens only: no decode step seen yet
        learner.observe_ttft(*_ttft(rng, learner))
    assert learner.model is None and predictor.model is None
    _feed(learner, 8, seed=2)
    assert learner.model is not None and predictor.model is learner.model


def test_a_coefficient_the_traffic_never_exercises_stays_at_the_prior():
    learner = StepTimeLearner(GENERIC_PRIOR, 8192)
    rng = random.Random(3)
    for _ in range(300):  # no decoding batch reads context, no prompt has attention pairs to speak of
        batch, _, rate, _ = _tpot(rng)
        learner.observe_tpot(batch, 0, rate, (TRUE.a + TRUE.b * batch) / (1 - TRUE.b * rate))
        terms = (1.0, float(rng.randint(1, 8192)), 0.0, 0.0, 1.0)
        learner.observe_ttft(terms, TRUE.a + TRUE.b * terms[1] + TRUE.e)
    m = learner.model
    assert m.a == pytest.approx(TRUE.a, rel=0.05) and m.b == pytest.approx(TRUE.b, rel=0.05)
    assert m.c == pytest.approx(GENERIC_PRIOR[2], rel=0.01) and m.d == pytest.approx(GENERIC_PRIOR[3], rel=0.01)


def test_requests_that_waited_for_something_else_do_not_drag_the_fit():
    learner = StepTimeLearner(GENERIC_PRIOR, 8192)
    _feed(learner, 100, seed=4)
    rng = random.Random(5)
    for i in range(400):
        terms, observed = _ttft(rng, learner)
        learner.observe_ttft(terms, observed * (6.0 if i % 10 == 0 else 1.0))  # one in ten waited for KV blocks
        learner.observe_tpot(*_tpot(rng))
    assert learner.model.b == pytest.approx(TRUE.b, rel=0.15)
    assert learner.model.a == pytest.approx(TRUE.a, rel=0.3)


def test_it_follows_an_engine_that_slows_down():
    learner = StepTimeLearner(GENERIC_PRIOR, 8192)
    _feed(learner, 200, seed=6)
    slow = StepTimeModel(TRUE.a * 3, TRUE.b * 3, TRUE.c * 3, 8192, TRUE.d * 3, TRUE.e)  # a neighbour took the GPU
    rng = random.Random(7)
    for _ in range(1500):
        learner.observe_ttft(*_ttft(rng, learner, truth=slow))
        learner.observe_tpot(*_tpot(rng, truth=slow))
    assert learner.model.b == pytest.approx(slow.b, rel=0.1)


def test_decode_terms_are_linear_in_the_coefficients():
    batch, ctx, rate, step = _tpot(random.Random(8))
    terms = decode_terms(batch, ctx, rate, step)
    assert sum(t * c for t, c in zip(terms, TRUE_TERMS, strict=True)) == pytest.approx(step)


def test_config_step_time_modes():
    base = make_config(tenants=[tenant("a")])
    model = base["models"][0]
    learned = parse_config({**base, "models": [{**model}]})
    assert learned.models[0].step_time.mode == "learned"
    given = parse_config({**base, "models": [{**model, "step_time": {"a": 0.01, "b": 1e-5}}]})
    assert given.models[0].step_time.mode == "given"
    prior = parse_config({**base, "models": [{**model, "step_time": {"mode": "learned", "a": 0.02}}]})
    assert prior.models[0].step_time.coefficients(GENERIC_PRIOR)[0] == 0.02
    with pytest.raises(ValueError, match="needs a and b"):
        parse_config({**base, "models": [{**model, "step_time": {"mode": "given"}}]})


def test_the_core_learns_from_its_own_requests_and_then_refuses_what_no_replica_can_meet():
    """No step time in the config: the core times its own requests (here by TRUE, at ten
    requests a second), and once warm predicts with the fit: a 1 ms TTFT is found infeasible."""
    core = make_core(replicas=1, tenants=[tenant("a", slo={"ttft_s": 5.0})])
    assert core.view.snapshot(0.0)["models"]["m"]["step_time"]["warm"] is False
    now = 0.0
    for i in range(40):
        now = i * 0.1
        observe_idle(core, now)
        (d,) = dispatched(core.offer(info("a", prompt=100 + 50 * i, max_tokens=8), now))
        first = now + TRUE.step(100 + 50 * i, 0)
        core.started(d.request_id, first)
        core.finished(d.request_id, first + 7 * TRUE.step(1, 100 + 50 * i), Terminal.COMPLETED, 8)
    snap = core.view.snapshot(now)["models"]["m"]["step_time"]
    assert snap["warm"] and snap["coefficients"]["b"] == pytest.approx(TRUE.b, rel=0.3)
    events = core.offer(info("a", prompt=2000, ttft_slo_s=0.001), now + 0.1)
    assert not dispatched(events) and "deadline_infeasible" in repr(events)


def test_a_whole_answer_is_not_taken_for_a_first_token():
    """A non-streamed answer's arrival is when its last token came: it must not move the TTFT
    correction (it would read a 64-token answer as a slow prefill), and the learner takes it as
    prefill plus decode steps."""
    step = {"a": TRUE.a, "b": TRUE.b, "c": TRUE.c, "d": TRUE.d}
    given = make_core(replicas=1, tenants=[tenant("a")], model={"step_time": step})
    observe_idle(given, 0.0)
    (d,) = dispatched(given.offer(info("a", prompt=500, max_tokens=64), 0.0))
    whole = TRUE.step(500, 0) + 63 * TRUE.step(1, 532)
    given.started(d.request_id, whole, measured=False)
    given.finished(d.request_id, whole, Terminal.COMPLETED, 64)
    latency = given.replicas[d.replica].latency
    assert (latency.ttft_factor, latency.tpot_factor) == (1.0, 1.0)

    learned = make_core(replicas=1, tenants=[tenant("a")])
    for i in range(20):
        now = float(i)
        observe_idle(learned, now)
        (d,) = dispatched(learned.offer(info("a", prompt=200 + 100 * i, max_tokens=64), now))
        whole = TRUE.step(200 + 100 * i, 0) + 63 * TRUE.step(1, 232 + 100 * i)
        learned.started(d.request_id, now + whole, measured=False)
        learned.finished(d.request_id, now + whole, Terminal.COMPLETED, 64)
    snap = learned.view.snapshot(30.0)["models"]["m"]["step_time"]
    assert snap["warm"] and snap["first_tokens_seen"] == 20


def _engine_timed_run(core, seconds: int) -> None:
    """Eight requests decoding on one replica at all times, their ends seen without their
    lengths (as the endpoint picker sees most answers); the replica scraped every 0.25 s with
    the engine's inter-token latency histogram as an engine running at TRUE would fill it."""
    name = next(iter(core.replicas))
    itl_sum = itl_count = 0.0
    live: list[str] = []
    now = 0.0
    core.observe(name, Telemetry(at=now, kv_usage=0.1, running=0, waiting=0, itl_sum=0.0, itl_count=0.0), now)
    for tick in range(seconds * 4):
        now = tick * 0.25
        while len(live) < 8:  # keep the batch at eight: one ends, the next begins
            (d,) = dispatched(core.offer(info("a", prompt=300, max_tokens=64), now))
            core.started(d.request_id, now + TRUE.step(300, 0))
            live.append(d.request_id)
        core.finished(live.pop(0), now, Terminal.COMPLETED, None)
        step = TRUE.step(8, core.replicas[name].decode_context)  # a token for each of the batch
        tokens = 8 * 0.25 / step
        itl_sum, itl_count = itl_sum + tokens * step, itl_count + tokens
        now += 0.25
        core.observe(name, Telemetry(at=now, kv_usage=0.1, running=8, waiting=0, itl_sum=itl_sum,
                                     itl_count=itl_count), now)


def test_a_front_that_reads_no_answer_learns_decode_speed_from_the_engines_inter_token_latency():
    """The endpoint picker's buffered setup sees each answer's first token and its end, not its
    length: no request gives a decode observation. With `decodes_from_engines`, each scrape's
    mean inter-token latency since the previous one does; without it, the fit never warms."""
    blind = make_core(replicas=1, tenants=[tenant("a")])
    _engine_timed_run(blind, 10)
    assert blind.view.snapshot(10.0)["models"]["m"]["step_time"]["decodes_seen"] == 0

    core = make_core(replicas=1, tenants=[tenant("a")])
    core.decodes_from_engines = True
    _engine_timed_run(core, 10)
    snap = core.view.snapshot(10.0)["models"]["m"]["step_time"]
    assert snap["warm"] and snap["decodes_seen"] >= 35
    learned = StepTimeModel(**snap["coefficients"], max_batched_tokens=8192)
    ctx = core.replicas[next(iter(core.replicas))].decode_context
    assert learned.step(8, ctx) == pytest.approx(TRUE.step(8, ctx), rel=0.15)


def test_an_interval_with_few_tokens_or_a_restarted_engine_says_nothing():
    core = make_core(replicas=1, tenants=[tenant("a")])
    core.decodes_from_engines = True
    name = next(iter(core.replicas))
    (d,) = dispatched(core.offer(info("a", prompt=300, max_tokens=64), 0.0))
    core.started(d.request_id, 0.1)
    learner = core.replicas[name].predictor.learner
    for at, total, count in ((0.0, 100.0, 5000.0), (0.25, 100.1, 5004.0), (0.5, 0.2, 10.0), (0.75, 0.5, 30.0)):
        core.observe(name, Telemetry(at=at, kv_usage=0.1, running=1, waiting=0, itl_sum=total, itl_count=count), at)
    assert learner.tpot_seen == 1  # only the last interval: 4 tokens are too few, a counter that fell is a restart
