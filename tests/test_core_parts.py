"""The core in named parts (issue #17): what the one finaliser settles, and reloads that change a
policy. Each of these failed when the layers lived in one class."""

from __future__ import annotations

import pytest

from bouncer.config import parse_config
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.outcomes import Terminal
from core_helpers import dispatched, info, make_config, make_core, observe_idle, rejected, tenant


def _trip(core, tenant_name: str, now: float) -> None:
    """Five upstream timeouts open the tenant's breaker (policy.breaker defaults)."""
    for i in range(5):
        (d,) = dispatched(core.offer(info(tenant_name), now))
        core.finished(d.request_id, now + 0.01 * i, Terminal.FAILED, reason="upstream_timeout")


@pytest.mark.parametrize("how", ["queue_full", "no_backend", "cancelled", "expired"])
def test_a_half_open_probe_refused_by_a_later_layer_does_not_lock_the_tenant_out(how):
    core = make_core(replicas=1, policy={"breaker": {"open_s": 5}, "queues": {"max_requests": 1}},
                     tenants=[tenant("a"), tenant("b")])
    _trip(core, "a", 0.0)
    assert rejected(core.offer(info("a"), 1.0))[0].refusal.reason == "circuit_open"
    now = 10.0  # open_s has passed: the next request of `a` is the half-open probe
    if how == "queue_full":
        core.observe(core.view.replica_names()[0], Telemetry(at=now, kv_usage=1.0, running=0, waiting=0), now)
        assert not dispatched(core.offer(info("b"), now))  # b's request fills the one-place waiting room
        (r,) = rejected(core.offer(info("a"), now))
        assert r.refusal.reason == "queue_full"
    elif how == "no_backend":
        core.observe(core.view.replica_names()[0], None, now)  # the replica stops answering
        (r,) = rejected(core.offer(info("a"), now))
        assert r.refusal.reason == "no_backend"
    else:
        core.observe(core.view.replica_names()[0], Telemetry(at=now, kv_usage=1.0, running=0, waiting=0), now)
        probe = info("a", ttl_s=1.0)
        assert core.offer(probe, now) == []  # queued: the replica is full
        if how == "cancelled":
            core.cancel(probe.request_id, now + 0.5)
        else:
            (r,) = rejected(core.tick(now + 1.0))
            assert r.refusal.reason == "ttl_expired"
    # the probe ended with neither success nor failure: the tenant is not locked out
    observe_idle(core, 300.0)
    events = core.offer(info("a"), 300.0)
    assert dispatched(events), events


def test_a_probe_out_too_long_without_news_is_given_up_on():
    core = make_core(replicas=1, policy={"breaker": {"open_s": 5}}, tenants=[tenant("a")])
    _trip(core, "a", 0.0)
    observe_idle(core, 10.0)
    (probe,) = dispatched(core.offer(info("a"), 10.0))  # the probe, dispatched; its stream hangs
    assert rejected(core.offer(info("a"), 11.0))[0].refusal.reason == "circuit_open"
    observe_idle(core, 16.0)
    assert dispatched(core.offer(info("a"), 16.0))  # after open_s with no news, another may probe
    core.finished(probe.request_id, 17.0, Terminal.COMPLETED, 10)


def test_a_reload_that_changes_the_ordering_reorders_what_is_queued():
    cfg = make_config(replicas=1, tenants=[tenant("a")], policy={"ordering": "fcfs"})
    core = make_core(replicas=1, tenants=[tenant("a")], policy={"ordering": "fcfs"})
    name = core.view.replica_names()[0]
    core.observe(name, Telemetry(at=0.0, kv_usage=1.0, running=0, waiting=0), 0.0)  # full: everything queues
    late = info("a", ttft_slo_s=30.0)  # first in, the later deadline
    early = info("a", ttft_slo_s=2.0)
    assert core.offer(late, 0.0) == [] and core.offer(early, 0.1) == []
    core.reload(parse_config({**cfg, "policy": {"ordering": "edf"}}), 0.2)
    (d,) = dispatched(core.observe(name, Telemetry(at=0.3, kv_usage=0.0, running=0, waiting=0), 0.3))[:1]
    assert d.request_id == early.request_id  # earliest deadline first, though it came second


def test_a_reload_that_changes_the_fairness_policy_takes_effect():
    cfg = make_config(replicas=1, tenants=[tenant("a")])
    core = make_core(replicas=1, tenants=[tenant("a")])
    assert core.models["m"].flow.fairness.name == "wdrr"
    core.reload(parse_config({**cfg, "policy": {"fairness": "round-robin"}}), 1.0)
    assert core.models["m"].flow.fairness.name == "round-robin"
    with pytest.raises(ValueError, match="policy.fairness.*'round-robin' or 'wdrr'"):
        parse_config({**cfg, "policy": {"fairness": "lottery"}})


def test_the_registry_implements_exactly_the_policy_names_the_config_accepts(monkeypatch):
    from bouncer.core import registry
    assert registry.unmatched_names() == []
    monkeypatch.setitem(registry.ORDERING, "lottery", registry.ORDERING["fcfs"])
    (difference,) = registry.unmatched_names()
    assert difference.startswith("ordering:") and "implements ['lottery'] the config does not accept" in difference


def test_a_first_attempt_refused_as_invalid_is_not_remembered_as_one():
    core = make_core(tenants=[tenant("a")])
    (r,) = rejected(core.offer(info("a", n=5, prompt_digest=7, retry_count=0), 0.0))
    assert r.refusal.reason == "invalid_parameter"
    assert len(core.stores.retries) == 0
    dispatched(core.offer(info("a", prompt_digest=7, retry_count=0), 0.0))
    assert len(core.stores.retries) == 1  # a valid first attempt is


def test_a_rate_limit_charge_is_refunded_when_a_later_layer_refuses():
    core = make_core(replicas=1, policy={"queues": {"max_requests": 1}},
                     tenants=[tenant("a", rate_limit={"requests_per_s": 1, "request_burst": 1}), tenant("b")])
    name = core.view.replica_names()[0]
    core.observe(name, Telemetry(at=0.0, kv_usage=1.0, running=0, waiting=0), 0.0)
    assert core.offer(info("b"), 0.0) == []  # fills the waiting room
    (r,) = rejected(core.offer(info("a"), 0.0))
    assert r.refusal.reason == "queue_full"  # after the rate limit charged it: refunded
    (r,) = rejected(core.offer(info("a"), 0.0))
    assert r.refusal.reason == "queue_full", "the first refusal's charge was kept"


def test_every_end_goes_through_the_finaliser_once():
    core = make_core(replicas=1, tenants=[tenant("a"), tenant("b", priority=-1)])
    (d,) = dispatched(core.offer(info("a"), 0.0))
    core.finished(d.request_id, 1.0, Terminal.COMPLETED, 10)
    core.finished(d.request_id, 1.0, Terminal.COMPLETED, 10)  # twice: the second is ignored
    core.cancel(d.request_id, 1.0)  # and so is a cancel of what is no longer queued
    assert core.stats.outcomes[Terminal.COMPLETED] == 1
    assert sum(core.stats.outcomes.values()) == core.stats.offered
