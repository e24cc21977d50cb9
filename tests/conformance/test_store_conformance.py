"""Every implementation of the core's state stores passes the contract its interface states
(bouncer/core/stores.py lists them). A shared implementation joins by being added to the
factories here."""

from __future__ import annotations

import pytest

from bouncer.config import RateLimit
from bouncer.core.fleet.permits import LocalPermits
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.flow.backlog import LocalBacklog
from bouncer.core.flow.fairness import LocalCredit
from bouncer.core.intake.rate_limit import LocalRateLimits
from bouncer.core.intake.retries import RetryLedger
from bouncer.core.outcomes import Reason
from bouncer.core.requests import Admission, RequestInfo

PERMITS = [LocalPermits]
RATE_LIMITS = [LocalRateLimits]
CREDIT = [LocalCredit]
RETRIES = [lambda: RetryLedger(remember_s=60, max_entries=3)]
BACKLOG = [LocalBacklog]


def _adm(rid: str, tenant: str = "t", prompt: int = 320) -> Admission:
    a = Admission(RequestInfo(rid, None, "m", prompt, 10), tenant, 0, 10, 10, arrival=0.0, deadline=60.0,
                  ttft_deadline=None)
    a.blocks, a.prefill_tokens = 21, prompt
    return a


@pytest.mark.parametrize("make", PERMITS)
def test_permits_grant_and_release_leave_counts_as_they_were(make):
    permits = make()
    r = ReplicaState("r0", "m", None, 1000, 16)
    replicas = {"r0": r}
    before = (r.inflight_blocks, r.unstarted, r.queued_prefill_tokens, len(r.inflight))
    a, b = _adm("a"), _adm("b")
    permits.grant(a, r, 1.0, lease_s=10)
    permits.grant(b, r, 1.0, lease_s=10)
    assert len(permits) == 2 and permits.get("a") is a and permits.tenant_blocks("t") == 42
    permits.started(a, r, 2.0)
    permits.started(a, r, 2.5)  # at most once
    assert r.unstarted == 1 and a.first_token_at == 2.0
    assert permits.release("a", replicas) is a and permits.release("a", replicas) is None
    assert permits.release("b", replicas) is b  # ended before its first token
    assert (r.inflight_blocks, r.unstarted, r.queued_prefill_tokens, len(r.inflight)) == before
    assert len(permits) == 0 and permits.tenant_blocks("t") == 0


@pytest.mark.parametrize("make", PERMITS)
def test_permits_are_leases_that_renewal_moves(make):
    permits = make()
    r = ReplicaState("r0", "m", None, 1000, 16)
    a, b = _adm("a"), _adm("b")
    permits.grant(a, r, 0.0, lease_s=10)
    permits.grant(b, r, 0.0, lease_s=10)
    permits.renew(["a", "unknown"], until=30.0)
    assert permits.expired(9.0) == [] and [x.request_id for x in permits.expired(11.0)] == ["b"]
    assert [x.request_id for x in permits.expired(31.0)] == ["a", "b"]


@pytest.mark.parametrize("make", RATE_LIMITS)
def test_rate_limits_take_atomically_and_refund(make):
    limits = make()
    limits.configure("t", RateLimit(requests_per_s=1, request_burst=2), now=0.0)
    assert limits.take("t", 10, 0.0) is None and limits.take("t", 10, 0.0) is None
    reason, wait = limits.take("t", 10, 0.0)
    assert reason is Reason.RATE_LIMITED_REQUESTS and wait == pytest.approx(1.0)
    limits.refund("t", 10, 0.0)
    assert limits.take("t", 10, 0.0) is None  # as if the refunded one had not come
    limits.configure("t", RateLimit(requests_per_s=1, request_burst=2), now=0.0)  # the same limits: kept
    assert limits.take("t", 10, 0.0) is not None
    limits.configure("t", RateLimit(tokens_per_min=600, token_burst=100), now=0.0)  # new ones: start full
    assert limits.take("t", 100, 0.0) is None and limits.take("t", 1, 0.0)[0] is Reason.RATE_LIMITED_TOKENS


@pytest.mark.parametrize("make", RATE_LIMITS)
def test_rate_limits_say_when_any_request_is_blocked_without_charging(make):
    limits = make()
    limits.configure("t", RateLimit(requests_per_s=1, request_burst=2, tokens_per_min=600, token_burst=50), now=0.0)
    assert limits.blocked("t", 0.0) is None
    assert limits.take("t", 30, 0.0) is None
    for _ in range(5):  # looking charges nothing
        assert limits.blocked("t", 0.0) is None
    assert limits.take("t", 20, 0.0) is None  # both buckets now empty
    reason, wait = limits.blocked("t", 0.0)
    assert reason is Reason.RATE_LIMITED_REQUESTS and wait == pytest.approx(1.0)
    assert limits.blocked("t", 1.0) is None  # a second later: a request and 10 tokens back
    limits.configure("u", RateLimit(tokens_per_min=600, token_burst=50), now=0.0)
    assert limits.take("u", 50, 0.0) is None
    reason, wait = limits.blocked("u", 0.0)  # no token left: however small, refused
    assert reason is Reason.RATE_LIMITED_TOKENS and wait == pytest.approx(0.1)


@pytest.mark.parametrize("make", CREDIT)
def test_credit_reads_zero_until_added_and_resets(make):
    credit = make()
    key = ("m", 0, "t")
    assert credit.get(key) == 0
    credit.add(key, 100)
    credit.add(key, -250)
    assert credit.get(key) == -150 and credit.get(("m", 0, "u")) == 0
    credit.reset(key)
    assert credit.get(key) == 0


@pytest.mark.parametrize("make", RETRIES)
def test_retries_remember_first_attempts_within_bounds(make):
    ledger = make()
    k = ("t", "m", 1, None)
    assert ledger.arrived(k, False, 1.0) == 1.0 and ledger.arrived(k, True, 5.0) == 1.0
    assert ledger.arrived(("t", "m", 2, None), True, 6.0) == 6.0  # a retry of one not remembered
    ledger.completed(k)
    assert ledger.arrived(k, True, 7.0) == 7.0
    for i in range(10):
        ledger.arrived(("t", "m", 100 + i, None), False, 8.0)
    assert len(ledger) <= 3
    assert ledger.arrived(("t", "m", 109, None), True, 100.0) == 100.0  # older than remember_s: forgotten


@pytest.mark.parametrize("make", BACKLOG)
def test_backlog_rates_need_enough_events_and_follow_them(make):
    backlog = make()
    assert backlog.dispatch_rate("m", 0.0) is None and backlog.completion_rate("m", 0.0) is None
    for i in range(20):
        backlog.note_dispatch("m", i * 0.5)
        backlog.note_departure("m", i * 0.25)
        backlog.note_completion("m", float(i))
    assert backlog.dispatch_rate("m", 9.5) == pytest.approx(2.0, rel=0.1)
    assert backlog.departure_rate("m", 5.0) == pytest.approx(4.0, rel=0.1)
    assert backlog.completion_rate("m", 19.0) == pytest.approx(1.0, rel=0.1)
    assert backlog.dispatch_rate("other", 9.5) is None  # per model
    assert backlog.dispatch_rate("m", 1000.0) is None  # the window moved on
