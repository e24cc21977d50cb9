"""The precheck: the layers that need no prompt, run before the gateway tokenizes one. What they
refuse is refused the same way `offer` would, counted once, and charges nothing; what passes
goes on to `offer` with its tenant."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def test_a_retry_past_its_first_deadline_is_refused_before_tokenizing_unless_its_tenant_demotes():
    core = make_core(tenants=[tenant("a", slo={"ttft_s": 2.0}), tenant("b", slo={"ttft_s": 2.0, "on_infeasible":
                                                                                    "best-effort"})])
    for name in ("a", "b"):
        core.finaliser.retries.arrived((name, "m", 42, 100), False, 0.0)  # its first attempt, at 0
    observe_idle(core, 2.5)
    r = core.precheck(head(prompt_digest=42, retry_count=1), 2.5)
    assert isinstance(r, Reject) and r.refusal.reason == "retry_past_deadline" and r.tenant == "a"
    assert "2.50 s after its first attempt" in r.refusal.message
    assert core.stats.arrived["a"] == 1 and core.stats.outcomes[Terminal.REFUSED] == 1
    # a first attempt with the same prompt, and a retry of a tenant that runs late work best-effort, pass
    assert not isinstance(core.precheck(head(prompt_digest=42, retry_count=0), 2.5), Reject)
    assert not isinstance(core.precheck(head(tenant_name="b", prompt_digest=42, retry_count=1), 2.5), Reject)
    # looking recorded nothing: the retry's first attempt is still the one at 0
    assert core.finaliser.retries.first_seen(("a", "m", 42, 100), 2.5) == 0.0


def test_a_retry_late_only_for_what_its_first_deadline_leaves_passes_the_precheck_and_offer_refuses_it():
    """The prefill queued on the only replica takes ~0.8 s: a retry 0.5 s after its first
    attempt (1 s SLO) cannot start in time. The precheck judges it on its whole SLO, so that
    `offer` runs the dispatch loop for it; `offer` refuses it, before any prefill."""
    from bouncer.sim.profiles import DEFAULT_PROFILE, get_profile

    core = make_core(tenants=[tenant("a", slo={"ttft_s": 1.0}), tenant("bulk")], replicas=1, kv_blocks=100_000,
                     max_model_len=32_768, model={"step_time": get_profile(DEFAULT_PROFILE).step_time_config},
                     policy={"max_inflight_per_replica": 1_000, "prefill_busy_tokens": 10 ** 9})
    for _ in range(3):
        assert dispatched(core.offer(info("bulk", prompt=8_000, max_tokens=10), 0.0))
    (replica,) = core.models["m"].replicas.values()
    assert 0.5 < replica.ttft_floor() < 1.0, replica.ttft_floor()
    core.finaliser.retries.arrived(("a", "m", 7, 100), False, 0.0)
    retry = head(prompt_digest=7, retry_count=1)
    checked = core.precheck(retry, 0.5)
    assert not isinstance(checked, Reject)
    (r,) = rejected(core.offer(dataclasses.replace(retry, prompt_tokens=100), 0.5, checked))
    assert r.refusal.reason == "deadline_infeasible"


@settings(max_examples=60, deadline=None)
@given(loaded=st.lists(st.integers(200, 30_000), min_size=0, max_size=16), queued_own=st.integers(0, 3),
       slo=st.floats(0.02, 1.0), prompt=st.integers(1, 6000), margin_seen=st.floats(0.3, 3.0),
       replicas=st.integers(1, 2), since_first=st.one_of(st.none(), st.floats(0.0, 1.2)))
def test_what_the_precheck_refuses_as_late_offer_refuses_too(loaded, queued_own, slo, prompt, margin_seen, replicas,
                                                              since_first):
    """Two cores fed the same calls: whatever the precheck of one refuses as late (its prompt
    unknown), the other's offer (skipping the precheck) refuses as well, prompt known, for the
    same reason; `since_first`: the request is a retry, its first attempt that long before."""
    from bouncer.core.outcomes import Reason
    from bouncer.sim.profiles import DEFAULT_PROFILE, get_profile

    step = get_profile(DEFAULT_PROFILE).step_time_config
    cores = []
    for _ in range(2):
        core = make_core(tenants=[tenant("a", slo={"ttft_s": slo}), tenant("bulk")], replicas=replicas,
                         kv_blocks=100_000,
                         max_model_len=32_768,
                         model={"step_time": step},
                         policy={"max_inflight_per_replica": 1_000, "prefill_busy_tokens": 10 ** 9})
        for ms in core.models.values():  # a band margin as if measured
            ms.ttft_margins.margin = lambda band, m=margin_seen: m
        for n in loaded:  # prefill queued on the replicas: dispatched, not started
            core.offer(info("bulk", prompt=n, max_tokens=10), 0.0)
        for _ in range(queued_own):
            core.offer(info("a", prompt=100, max_tokens=10, ttl_s=600), 0.0)
        cores.append(core)
    now = 0.0
    request = info("a", prompt=prompt, max_tokens=10)
    if since_first is not None:
        now = 1.5  # what was loaded at 0 is still there: nothing finishes between calls
        request = info("a", prompt=prompt, max_tokens=10, prompt_digest=7, retry_count=1)
        for core in cores:
            core.finaliser.retries.arrived(("a", "m", 7, 10), False, now - since_first)
    checked = cores[0].precheck(request, now)
    late = (Reason.DEADLINE_INFEASIBLE, Reason.RETRY_PAST_DEADLINE)
    if isinstance(checked, Reject) and checked.refusal.reason in late:
        t = cores[1].tenants.get("a")
        events = cores[1].offer(request, now, t)
        assert not dispatched(events)
        assert any(r.request_id == request.request_id and r.refusal.reason == checked.refusal.reason
                   for r in rejected(events)), events


@settings(max_examples=150, deadline=None)
@given(texts=st.lists(st.text(max_size=400), min_size=1, max_size=4), chat=st.booleans(), bundled=st.booleans())
def test_the_bound_known_before_tokenizing_never_exceeds_the_count(texts, chat, bundled):
    """`min_prompt_tokens` (bytes over the longest token's) is at most what tokenizing gives, with
    the bundled tokenizer and with the estimate, for chats and for completions."""
    from bouncer.gateway.request_parsing import min_prompt_tokens, request_head, with_prompt
    from bouncer.openai_wire import ApiError

    tok = _bundled() if bundled else None
    body = ({"model": "m", "messages": [{"role": "user", "content": t} for t in texts]} if chat
            else {"model": "m", "prompt": texts[0]})
    kind = "chat" if chat else "completion"
    try:
        head_ = request_head("r", kind, body, {}, tok)
    except ApiError:
        return  # a prompt the gateway refuses is never counted
    full = with_prompt(head_, kind, body, tok, 16)
    assert head_.min_prompt_tokens <= full.prompt_tokens
    assert min_prompt_tokens(kind, body.get("messages") or body["prompt"], tok) == head_.min_prompt_tokens


_TOKENIZER = []


def _bundled():
    from bouncer.tokenizer import PromptTokenizer

    if not _TOKENIZER:
        _TOKENIZER.append(PromptTokenizer())
    return _TOKENIZER[0]


def test_a_prompt_that_would_overfill_its_tenants_queued_tokens_is_refused_untokenized():
    core = make_core(tenants=[tenant("a")], replicas=1, kv_blocks=100,
                     policy={"queues": {"tenant_max_tokens": 5_000}, "max_inflight_per_replica": 1})
    core.offer(info("a", prompt=3_000, max_tokens=10), 0.0)  # runs
    core.offer(info("a", prompt=3_000, max_tokens=10, ttl_s=60), 0.0)  # queued: 3,000 tokens
    assert len(core.models["m"].flow) == 1
    small, large = (dataclasses.replace(head(tenant_name="a"), min_prompt_tokens=n) for n in (1_000, 2_500))
    assert not isinstance(core.precheck(small, 0.0), Reject)  # 4,000 queued would fit
    refused = core.precheck(large, 0.0)
    assert isinstance(refused, Reject) and refused.refusal.reason == "tenant_queue_full"
