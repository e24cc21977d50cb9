"""Standing queues (bouncer.core.flow.standing_queue): under sustained overload a tenant's newcomers
are planned on a share of their SLO; a burst leaves the plan alone. And the top band, protected
more for a while after it missed (bouncer.core.flow.band_slos.BandSLOs)."""

from __future__ import annotations

import pytest

from bouncer.config import SLO as SLOConfig
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.flow.band_slos import STRAINED_S, STRAINED_SLO_SHARE, BandSLOs
from bouncer.core.flow.standing_queue import ENTER_SHARE, EXIT_SHARE, MIN_INTERVAL_S, StandingQueues
from bouncer.core.outcomes import Terminal
from core_helpers import dispatched, info, observe_idle, rejected, tenant
from test_latency import core_with_steps

SLO = 2.0  # its interval is MIN_INTERVAL_S = 2 s too


def _interval(q: StandingQueues, start: float, share: float, tenant: str = "a", n: int = 10) -> None:
    """`n` departures of `tenant`'s band-0 requests over one interval from `start`, each having
    waited `share` of its SLO."""
    for i in range(n):
        q.departed(0, tenant, share * SLO, SLO, start + i * MIN_INTERVAL_S / n)


def test_a_queue_whose_requests_waited_most_of_their_slo_for_an_interval_stands():
    q = StandingQueues()
    _interval(q, 0.0, ENTER_SHARE + 0.1)
    assert not q.standing(0, "a", 1.9)  # judged when the interval is over, not before
    q.departed(0, "a", 0.0, SLO, 2.0)
    assert q.standing(0, "a", 2.0) and q.snapshot(2.0) == [{"band": 0, "tenant": "a"}]
    assert not q.standing(0, "b", 2.0) and not q.standing(1, "a", 2.0)  # per band and tenant


def test_a_sheddable_band_never_stands():
    """It is served from spare capacity, in bursts as saturation dips under its ceiling: its
    queue is what fills them (module doc)."""
    q = StandingQueues()
    for band in (-1, 0):
        for i in range(10):
            q.departed(band, "a", 0.9 * SLO, SLO, i * MIN_INTERVAL_S / 10)
        q.departed(band, "a", 0.9 * SLO, SLO, MIN_INTERVAL_S)
    assert q.standing(0, "a", MIN_INTERVAL_S)
    assert not q.standing(-1, "a", MIN_INTERVAL_S) and q.snapshot(MIN_INTERVAL_S) == [{"band": 0, "tenant": "a"}]


def test_a_burst_within_an_interval_does_not_stand():
    q = StandingQueues()
    for i in range(10):  # the first few waited nearly all their SLO, the rest went at once
        q.departed(0, "a", (0.95 if i < 4 else 0.05) * SLO, SLO, i * 0.2)
    q.departed(0, "a", 0.0, SLO, 2.0)
    assert not q.standing(0, "a", 2.0)


def test_a_standing_queue_stands_until_it_drains():
    q = StandingQueues()
    _interval(q, 0.0, 0.9)
    _interval(q, 2.0, (EXIT_SHARE + ENTER_SHARE) / 2)  # shorter waits, as the share it is planned on gives
    _interval(q, 4.0, EXIT_SHARE / 2)  # drained
    q.departed(0, "a", 0.0, SLO, 6.0)
    assert not q.standing(0, "a", 6.0)


def test_a_queue_idle_for_an_interval_no_longer_stands():
    q = StandingQueues()
    _interval(q, 0.0, 0.9)
    q.departed(0, "a", 0.9 * SLO, SLO, 2.0)
    assert q.standing(0, "a", 3.9)
    assert not q.standing(0, "a", 2.0 + 2 * MIN_INTERVAL_S)  # nothing left the queue for a whole interval


def _full(core, now: float) -> None:
    core.observe("m/0", Telemetry(at=now, kv_usage=0.99, running=50, waiting=0), now)  # nothing fits


def test_the_core_plans_a_standing_queues_newcomers_on_a_share_of_their_slo():
    core = core_with_steps([tenant("a", slo={"ttft_s": SLO})])
    # one request queued at a time expires after waiting its whole budget (2 s less twice its
    # 0.02 s TTFT), twice over an interval: the tenant's queue stands. Beside them, prompts
    # refused as they arrive (their prefill alone outlasts the SLO) wait nothing, and are not
    # counted as if they had gone at once
    for t in (0.0, 2.0):
        _full(core, t)
        core.offer(info("a", prompt=100), t)
        for i in range(20):
            (late,) = rejected(core.offer(info("a", prompt=30_000), t + 0.5 + i * 0.01))
            assert (late.refusal.reason, late.terminal) == ("deadline_infeasible", Terminal.REFUSED)
        (r,) = rejected(core.tick(t + 1.97))
        assert r.terminal is Terminal.EXPIRED
    assert core.snapshot(4.0)["models"]["m"]["standing_queues"] == [{"band": 0, "tenant": "a"}]
    _full(core, 4.0)
    core.offer(info("a", prompt=100), 4.0)
    # planned on standing_queue_share (0.7) of its 2 s: it may wait 1.4 s less room for its TTFT
    assert core.next_wakeup() == pytest.approx(4.0 + core.policy.standing_queue_share * SLO - 2 * 0.02)
    # and one late on that plan says so
    (r,) = rejected(core.offer(info("a", prompt=7_000), 4.1))
    assert "while their queue stands" in r.refusal.message


def test_off_a_standing_queue_is_planned_on_its_whole_slo():
    core = core_with_steps([tenant("a", slo={"ttft_s": SLO})], policy={"standing_queue_share": 1.0})
    for t in (0.0, 2.0):
        _full(core, t)
        core.offer(info("a", prompt=100), t)
        core.tick(t + 1.97)
    _full(core, 4.0)
    core.offer(info("a", prompt=100), 4.0)
    assert core.next_wakeup() == pytest.approx(4.0 + SLO - 2 * 0.02)


# -- the top band, protected more while it misses (band_slos.BandSLOs) ----------------------------

def test_the_top_band_is_protected_as_if_its_slo_were_shorter_for_a_while_after_it_missed():
    slos = BandSLOs()
    for band, slo in ((10, 0.5), (0, 5.0)):
        slos.note(band, SLOConfig(ttft_s=slo), 0.0)
    assert slos.protected(0, 1.0)[0] == 0.5 and slos.protected(-1, 1.0)[0] == 0.5
    slos.missed(10, 1.0)
    assert slos.protected(0, 1.0)[0] == pytest.approx(0.5 * STRAINED_SLO_SHARE)
    assert slos.protected(0, 1.0 + STRAINED_S + 0.1)[0] == 0.5  # it has not missed since
    slos.missed(0, 2.0)  # a lower band's miss does not tighten what the band below it is held to
    assert slos.protected(-1, 2.0)[0] == pytest.approx(0.5 * STRAINED_SLO_SHARE)
    assert slos.protected(-1, 5.0)[0] == 0.5


def test_a_top_band_refused_as_late_holds_a_lower_bands_prompt_the_reserve_let_through_before():
    def lower_band_prompt_after_a_miss(miss: bool) -> list:
        core = core_with_steps([tenant("rt", 10, slo={"ttft_s": 0.5}), tenant("std")])
        (d,) = dispatched(core.offer(info("rt", prompt=10), 0.0))
        core.started(d.request_id, 0.05)
        if miss:  # 6,000 tokens of prefill: 0.66 s, late for 0.5 s wherever it goes
            (r,) = rejected(core.offer(info("rt", prompt=6_000), 0.1))
            assert r.refusal.reason == "deadline_infeasible"
        # 900 tokens: one step (0.1 s) ahead of the realtime band's next request, within a
        # quarter of its 0.5 s SLO (ttft_reserve_fraction), not within a quarter of 0.4 x 0.5 s
        return dispatched(core.offer(info("std", prompt=900), 0.2))

    assert lower_band_prompt_after_a_miss(False)
    assert lower_band_prompt_after_a_miss(True) == []


def test_a_first_token_past_its_deadline_is_its_bands_miss():
    core = core_with_steps([tenant("rt", 10, slo={"ttft_s": 0.5})])
    (d,) = dispatched(core.offer(info("rt", prompt=10), 0.0))
    core.started(d.request_id, 0.7)
    assert core.models["m"].band_slos.strained(10, 0.7)
    observe_idle(core, 10.0)
    (d,) = dispatched(core.offer(info("rt", prompt=10), 10.0))
    core.started(d.request_id, 10.1)
    assert not core.models["m"].band_slos.strained(10, 10.1)
