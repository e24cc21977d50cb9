"""Retry-After from how long a tenant's refusals took to be answered (bouncer.core.flow.comebacks)."""

from __future__ import annotations

import pytest

from bouncer.core.fleet.replica import Telemetry
from bouncer.core.flow.comebacks import MAX_FOLLOWED, WINDOW_S, Comebacks
from bouncer.core.outcomes import Terminal
from core_helpers import dispatched, info, make_core, rejected, tenant


def test_no_estimate_until_enough_of_its_refusals_were_answered():
    c = Comebacks()
    assert c.refused("a", 0.0) is None
    c.dispatched("a", sent_at=0.5, now=2.0)  # sent after the refusal: answers it, 2 s on
    assert c.refused("a", 3.0) is None and c.refused("a", 3.1) is None  # one answered: too few


def test_retry_after_is_the_median_lag_of_its_refusals_answered_lately():
    c = Comebacks()
    for t in (0.0, 1.0, 2.0):
        c.refused("a", t)
    c.dispatched("a", sent_at=1.5, now=4.0)  # answers the refusals at 0 and 1: lags 4 and 3
    c.dispatched("a", sent_at=1.9, now=4.5)  # sent before the refusal at 2: answers nothing
    c.dispatched("a", sent_at=2.5, now=5.0)  # answers the one at 2: lag 3
    assert c.refused("a", 5.0) == pytest.approx(3)  # of 4, 3, 3
    # another tenant's refusals are its own
    assert c.refused("b", 5.0) is None


def test_one_long_wait_does_not_set_what_the_others_are_told():
    """A busy tenant's refusals are mostly answered by its next admission soon after; one that
    waited through a long stretch without any would put the mean at 2.7 s where most came back
    within 0.3 s."""
    c = Comebacks()
    c.refused("a", 0.0)
    c.dispatched("a", sent_at=0.1, now=10.0)  # lag 10
    for t in (10.0, 10.5, 11.0):
        c.refused("a", t)
        c.dispatched("a", sent_at=t + 0.1, now=t + 0.2 + (t - 10.0) / 10)  # lags 0.2, 0.25, 0.3
    assert c.refused("a", 12.0) == pytest.approx((0.25 + 0.3) / 2)  # of 0.2, 0.25, 0.3, 10


def test_answers_older_than_the_window_no_longer_count():
    c = Comebacks()
    for t in (0.0, 0.1, 0.2):
        c.refused("a", t)
    c.dispatched("a", sent_at=0.3, now=1.0)
    assert c.refused("a", 1.0 + WINDOW_S - 0.01) is not None
    assert c.refused("a", 1.0 + WINDOW_S + 0.01) is None


def test_refusals_not_answered_yet_count_at_twice_how_long_they_have_waited():
    c = Comebacks()
    for t in (0.0, 1.0):
        c.refused("a", t)
    assert c.refused("a", 2.0) is None  # two followed: too few
    # none answered: a starved tenant is told as long again as its refusals have waited so far
    assert c.refused("a", 25.0) == pytest.approx(2 * 24)  # waited 25, 24 and 23
    c.dispatched("a", sent_at=2.5, now=26.0)  # answers the first three (lags 26, 25, 24)
    # and the one at 25 has waited 2: expected to wait 4
    assert c.refused("a", 27.0) == pytest.approx((24 + 25) / 2)


def test_a_tenant_never_refused_is_not_followed():
    c = Comebacks()
    c.dispatched("a", sent_at=0.0, now=0.1)
    assert c.refused("a", 1.0) is None


def test_refusals_followed_are_bounded_the_oldest_kept():
    c = Comebacks()
    for i in range(MAX_FOLLOWED + 100):
        c.refused("a", i * 0.02)
    last = (MAX_FOLLOWED + 100) * 0.02
    # the first MAX_FOLLOWED are followed, the oldest from 0: a starved tenant's wait counts from it
    # (twice the wait of the middle one, at (MAX_FOLLOWED - 1) / 2 * 0.02)
    assert c.refused("a", last) == pytest.approx(2 * (last - (MAX_FOLLOWED - 1) * 0.02 / 2))


def test_the_core_tells_a_refused_tenant_how_long_its_last_refusals_took_to_be_answered():
    core = make_core(replicas=1, policy={"max_inflight_per_replica": 1,
                                         "queues": {"tenant_max_requests": 1}})
    [a] = dispatched(core.offer(info(), 0.0))
    assert not core.offer(info(), 0.0)  # queued behind it: the tenant's queue is full
    for t in (1.0, 1.1, 1.2):
        [r] = rejected(core.offer(info(), t))
        assert r.refusal.reason == "tenant_queue_full"
    [b] = dispatched(core.finished(a.request_id, 3.0, Terminal.COMPLETED))  # sent before them
    assert not core.offer(info(), 3.0)  # sent after them: queued
    [f] = dispatched(core.finished(b.request_id, 5.0, Terminal.COMPLETED))  # it answers them
    assert not core.offer(info(), 5.0)
    [r] = rejected(core.offer(info(), 5.1))
    assert r.refusal.retry_after == pytest.approx((4.0 + 3.9 + 3.8) / 3)


def test_sheddable_traffic_refused_as_saturated_is_told_no_sooner_than_the_backlog_above_turns_over():
    """Its own refusals lately answered in 0.3 s say nothing of how long the pool stays saturated:
    it gets in once the 20 requests queued above it have left, at 10 a second."""
    core = make_core(replicas=1, tenants=[tenant("a"), tenant("free", priority=-1)])
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.99, running=50, waiting=0), 0.0)  # saturated
    for _ in range(20):
        assert not core.offer(info("a"), 0.0)  # band 0 waits, ahead of the free tier
    backlog = core.models["m"].backlog
    for t in (0.1, 0.2, 0.3):
        backlog.comebacks.refused("free", t)
    backlog.comebacks.dispatched("free", sent_at=0.35, now=0.5)  # answered 0.3 s on, on average
    for i in range(10):
        backlog.store.note_departure("m", 0.5 + i * 0.01)  # the room turns over at 10 a second
    [r] = rejected(core.offer(info("free"), 0.9))
    assert r.refusal.reason == "saturated"
    assert r.refusal.retry_after == pytest.approx(20 / 10)
    # a refusal of its own (not the pool's saturation) is told its refusals' lag
    # (the median of lags 0.4, 0.3 and 0.2, and of the refusal at 0.9, waiting 0.05 s so far: 0.1)
    assert backlog.retry_after(-1, 0.95, "free") == pytest.approx((0.2 + 0.3) / 2)
