"""The precheck: the layers that need no prompt, run before the gateway tokenizes one. What they
refuse is refused the same way `offer` would, counted once, and charges nothing; what passes
goes on to `offer` with its tenant."""

from __future__ import annotations

import dataclasses

import pytest

from bouncer.core.outcomes import Reject, Terminal
from core_helpers import dispatched, info, make_core, observe_idle, rejected, tenant


def head(**kw):
    """A request as the gateway has it before tokenizing: no prompt tokens, no blocks."""
    return dataclasses.replace(info(**kw), prompt_tokens=0, block_digests=[])


def test_what_passes_goes_on_to_offer_and_is_counted_once():
    core = make_core()
    h = head()
    t = core.precheck(h, 0.0)
    assert not isinstance(t, Reject) and t.name == "a"
    (d,) = dispatched(core.offer(dataclasses.replace(h, prompt_tokens=100), 0.0, t))
    assert core.stats.offered == 1 and core.stats.arrived["a"] == 1 and d.tenant == "a"


def test_over_its_request_rate_a_request_is_refused_untokenized_and_charges_nothing():
    core = make_core(tenants=[tenant("a", rate_limit={"requests_per_s": 1, "request_burst": 1})])
    assert dispatched(core.offer(info(), 0.0))
    r = core.precheck(head(), 0.1)
    assert isinstance(r, Reject) and r.refusal.reason == "rate_limited_requests"
    assert r.refusal.retry_after == pytest.approx(0.9)
    assert core.stats.arrived["a"] == 2 and core.stats.outcomes[Terminal.REFUSED] == 1
    # looking took nothing: a second later the bucket holds the one request it refilled
    assert not isinstance(core.precheck(head(), 1.0), Reject)
    assert dispatched(core.offer(info(), 1.0))


def test_a_full_tenant_queue_and_a_saturated_pool_refuse_before_tokenizing():
    core = make_core(tenants=[tenant("a"), tenant("free", -1)], replicas=1, kv_blocks=100,
                     policy={"kv_busy_threshold": 0.9, "kv_resume_threshold": 0.5, "saturation": {"kv_threshold": 1.0},
                             "queues": {"tenant_max_requests": 2}, "sheddable_ceiling": 0.5})
    for _ in range(6):
        assert dispatched(core.offer(info(), 0.0))
    for _ in range(2):
        assert core.offer(info(), 0.0) == []  # queued
    r = core.precheck(head(), 0.0)
    assert isinstance(r, Reject) and r.refusal.reason == "tenant_queue_full" and r.refusal.status == 429
    r = core.precheck(head(tenant_name="free"), 0.0)
    assert isinstance(r, Reject) and r.refusal.reason == "saturated"
    # the same requests through offer alone are refused for the same reasons
    assert rejected(core.offer(info(), 0.0))[0].refusal.reason == "tenant_queue_full"
    assert rejected(core.offer(info("free"), 0.0))[0].refusal.reason == "saturated"


def test_an_open_breaker_refuses_and_the_precheck_does_not_take_its_probe():
    core = make_core(policy={"breaker": {"failures": 2, "window_s": 10, "open_s": 5}})
    for t in (0.0, 1.0):
        (d,) = dispatched(core.offer(info(), t))
        core.finished(d.request_id, t + 0.5, Terminal.FAILED, reason="upstream_timeout")
    r = core.precheck(head(), 2.0)
    assert isinstance(r, Reject) and r.refusal.reason == "circuit_open" and r.refusal.retry_after == pytest.approx(4.5)
    observe_idle(core, 7.0)
    for _ in range(3):  # half-open: looking leaves the one probe for the request that goes on
        assert not isinstance(core.precheck(head(), 7.0), Reject)
    (probe,) = dispatched(core.offer(info(), 7.0))
    assert isinstance(core.precheck(head(), 7.1), Reject)  # its probe is out


def test_unknown_keys_and_models_are_refused_as_offer_refuses_them():
    core = make_core()
    r = core.precheck(dataclasses.replace(head(), key_digest="0" * 64), 0.0)
    assert isinstance(r, Reject) and r.refusal.reason == "unauthenticated" and r.tenant == "-"
    r = core.precheck(head(model="nope"), 0.0)
    assert isinstance(r, Reject) and r.refusal.reason == "model_not_found"


def test_a_retry_of_a_request_the_precheck_refused_keeps_its_first_deadline():
    core = make_core(tenants=[tenant("a", slo={"ttft_s": 2.0}, rate_limit={"requests_per_s": 1, "request_burst": 1})],
                     policy={"retries": {"deadline": "first-attempt"}})
    assert dispatched(core.offer(info(), 0.0))
    first = core.precheck(head(prompt_digest=42, retry_count=0), 0.5)
    assert isinstance(first, Reject) and first.refusal.reason == "rate_limited_requests"
    # its retry, 3 s later, is past the first attempt's 2 s deadline
    observe_idle(core, 3.5)
    (r,) = rejected(core.offer(info(prompt_digest=42, retry_count=1), 3.5))
    assert r.refusal.reason == "retry_past_deadline"
