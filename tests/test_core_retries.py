"""Retries that keep their first attempt's deadline (policy.retries.deadline: first-attempt)."""

from __future__ import annotations

from bouncer.core.intake.retries import RetryLedger
from bouncer.core.outcomes import Terminal
from bouncer.core.sharing.first_attempts import SharedRetries
from core_helpers import admission_of, dispatched, info, make_core, observe_idle, tenant

FIRST_ATTEMPT = {"retries": {"deadline": "first-attempt"}}  # the default, stated


def sla_core(policy=None, on_infeasible="refuse"):
    return make_core(replicas=1, policy=policy,
                     tenants=[tenant("a", slo={"ttft_s": 1.0, "on_infeasible": on_infeasible})])


def offer_one(core, now, retry_count, digest=7):
    observe_idle(core, now)  # fresh telemetry: the replica takes it at once
    ev = dispatched(core.offer(info("a", prompt_digest=digest, retry_count=retry_count), now))
    assert len(ev) == 1
    return admission_of(core, ev[0])


def test_ledger_keeps_the_first_arrival_for_retries_only():
    ledger = RetryLedger(remember_s=60, max_entries=10)
    key = ("a", "m", 1, 100)
    assert ledger.arrived(key, retry=False, now=1.0) == 1.0
    assert ledger.arrived(key, retry=True, now=3.0) == 1.0
    assert ledger.arrived(key, retry=False, now=5.0) == 5.0  # sent again, not as a retry: a new request
    ledger.completed(key)
    assert ledger.arrived(key, retry=True, now=6.0) == 6.0  # its first attempt is not known: it starts now


def test_looking_up_a_first_attempt_records_nothing_and_honours_remember_s():
    for ledger in (RetryLedger(remember_s=10, max_entries=10), SharedRetries(remember_s=10, max_entries=10)):
        key = ("a", "m", 1, 100)
        assert ledger.first_seen(key, 1.0) is None and len(ledger) == 0
        ledger.arrived(key, retry=False, now=1.0)
        assert ledger.first_seen(key, 5.0) == 1.0
        assert ledger.first_seen(key, 11.5) is None  # older than remember_s
    # several gateways: the earlier of what the shared store said and what this one saw
    shared = SharedRetries(remember_s=10, max_entries=10)
    shared.arrived(key, retry=False, now=2.0)
    shared.prefetch(key, 0.5)
    assert shared.first_seen(key, 3.0) == 0.5
    assert shared.arrived(key, retry=True, now=3.0) == 0.5


def test_ledger_forgets_old_and_excess_first_attempts():
    ledger = RetryLedger(remember_s=10, max_entries=2)
    ledger.arrived(("a", "m", 1, None), retry=False, now=0.0)
    ledger.arrived(("a", "m", 2, None), retry=False, now=1.0)
    ledger.arrived(("a", "m", 3, None), retry=False, now=2.0)
    assert len(ledger) == 2  # the oldest went first
    assert ledger.arrived(("a", "m", 1, None), retry=True, now=3.0) == 3.0
    assert ledger.arrived(("a", "m", 3, None), retry=True, now=11.5) == 2.0
    assert ledger.arrived(("a", "m", 2, None), retry=True, now=11.5) == 11.5  # older than remember_s


def test_a_retry_keeps_its_first_attempts_deadline():
    core = sla_core(FIRST_ATTEMPT)
    first = offer_one(core, 0.0, retry_count=0)
    assert first.ttft_deadline == 1.0
    core.cancel(first.request_id, 0.3)  # its client gave up waiting, and retries
    retry = offer_one(core, 0.5, retry_count=1)
    assert retry.ttft_deadline == 1.0 and not retry.best_effort


def test_a_retry_past_its_deadline_is_refused_as_its_tenant_says():
    core = sla_core(FIRST_ATTEMPT)
    first = offer_one(core, 0.0, retry_count=0)
    core.cancel(first.request_id, 0.3)
    observe_idle(core, 2.0)
    (reject,) = core.offer(info("a", prompt_digest=7, retry_count=1), 2.0)
    r = reject.refusal
    # another retry cannot meet that deadline either: no Retry-After, and clients are told not to retry
    assert (r.status, r.reason) == (429, "retry_past_deadline") and r.retry_after is None and not r.should_retry
    assert "2.00 s after its first attempt" in r.message


def test_a_retry_past_its_deadline_runs_best_effort_if_its_tenant_says_so():
    core = sla_core(FIRST_ATTEMPT, on_infeasible="best-effort")
    first = offer_one(core, 0.0, retry_count=0)
    core.cancel(first.request_id, 0.3)
    assert core.snapshot(0.5)["retries_remembered"] == 1  # what /admin/state shows
    late = offer_one(core, 2.0, retry_count=1)
    assert late.best_effort and late.ttft_deadline is None
    assert late.priority == core.policy.best_effort_priority
    assert core.stats.decisions[("demoted", "slo", "retry_past_deadline", "a", late.priority)] == 1


def test_without_the_clients_retry_count_or_the_policy_a_request_is_new():
    core = sla_core(FIRST_ATTEMPT)
    first = offer_one(core, 0.0, retry_count=0)
    core.cancel(first.request_id, 0.3)
    assert offer_one(core, 2.0, retry_count=None).ttft_deadline == 3.0  # no header: not known as a retry
    core = sla_core({"retries": {"deadline": "fresh"}})
    first = offer_one(core, 0.0, retry_count=0)
    core.cancel(first.request_id, 0.3)
    assert offer_one(core, 2.0, retry_count=1).ttft_deadline == 3.0


def test_a_completed_request_is_forgotten_and_other_prompts_are_other_requests():
    core = sla_core(FIRST_ATTEMPT)
    first = offer_one(core, 0.0, retry_count=0)
    core.started(first.request_id, 0.1)
    core.finished(first.request_id, 0.2, Terminal.COMPLETED, completion_tokens=5)
    assert offer_one(core, 2.0, retry_count=1).ttft_deadline == 3.0
    assert offer_one(core, 2.5, retry_count=1, digest=8).ttft_deadline == 3.5
