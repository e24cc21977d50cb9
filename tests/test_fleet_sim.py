"""The fleet simulator's accounting and each baseline's defining behaviour."""

from __future__ import annotations

import dataclasses

import pytest

from bouncer.sim.fleet import FleetConfig, FleetSim, SimRequest
from bouncer.sim.policies import (
    BOUNCER_POLICY,
    LLMD_POLICY,
    CorePolicy,
    DynamoBusy,
    NoAdmission,
    TgiCap,
    VllmQueueCap,
    core_config,
    tenant_config,
)
from bouncer.sim.profiles import get_profile
from bouncer.sim.traces import TraceRequest
from bouncer.sim.workloads import TenantSpec, make_requests, measure_capacity

PROFILE = dataclasses.replace(get_profile("llama-3.1-8b-h100"), max_model_len=8192)
NAMES = ["r0", "r1"]
KV = 2000  # blocks of 16 per replica: 32k tokens


def cfg(**kw) -> FleetConfig:
    return FleetConfig(replicas=2, profile=PROFILE, kv_blocks=KV, max_num_seqs=128, **kw)


def policies():
    tenants = [tenant_config("gold", 10), tenant_config("free", -1)]
    return {
        "none": lambda: NoAdmission(NAMES),
        "tgi-cap": lambda: TgiCap(NAMES),
        "vllm-queue-cap": lambda: VllmQueueCap(NAMES),
        "dynamo-busy": lambda: DynamoBusy(NAMES, KV, 16, PROFILE.max_num_batched_tokens),
        "llmd-flow-control": lambda: CorePolicy("llmd-flow-control",
                                                core_config(tenants, 2, KV, 16, 8192, LLMD_POLICY)),
        "bouncer": lambda: CorePolicy("bouncer", core_config(tenants, 2, KV, 16, 8192, BOUNCER_POLICY)),
    }


def trace(n: int = 400) -> list[TraceRequest]:
    return [TraceRequest(t=i * 0.1, prompt_len=500 + (i * 37) % 1500, output_len=50 + (i * 13) % 300)
            for i in range(n)]


def workload(load_rate: float, seconds: float = 40.0) -> list[SimRequest]:
    tenants = [TenantSpec("gold", 10, 0.3, "t", ttft_slo=1.0, tpot_slo=0.1, timeout_s=20),
               TenantSpec("free", -1, 0.7, "t", ttft_slo=10.0, timeout_s=20)]
    return make_requests(tenants, {"t": trace()}, load_rate, seconds, seed=3)


@pytest.mark.parametrize("name", list(policies()))
def test_every_request_gets_exactly_one_outcome_under_overload(name):
    reqs = workload(load_rate=60.0)
    policy = policies()[name]()
    extra = {"max_num_queued_reqs": 64} if name == "vllm-queue-cap" else {}
    res = FleetSim(cfg(**extra), policy, policy.replica_names).run(reqs)
    assert res.lost == 0
    assert sum(res.outcomes.values()) == len(reqs)
    assert set(res.outcomes) <= {"completed", "refused", "expired", "abandoned", "failed"}
    for r in reqs:
        if r.outcome == "completed":
            assert r.arrival <= r.first_token_at <= r.finished_at
    assert res.outcomes["completed"] > 0
    # nothing is left holding KV or permits
    if isinstance(policy, CorePolicy):
        assert not policy.core.view.inflight and policy.core.view.queued == 0


def test_no_admission_queues_at_the_engine():
    reqs = workload(load_rate=80.0, seconds=20)
    res = FleetSim(cfg(), NoAdmission(NAMES), NAMES).run(reqs)
    assert not res.refused_by_reason
    assert max(s["engine_waiting"] for s in res.samples) > 20


def test_tgi_cap_refuses_beyond_128_concurrent_per_replica():
    reqs = [SimRequest(f"q{i}", "gold", 0, 0.0, 4000, 500, 500, [], None, None, 1e6, 0) for i in range(300)]
    policy = TgiCap(NAMES)
    res = FleetSim(cfg(), policy, NAMES).run(reqs)
    assert res.refused_by_reason["tgi/overloaded"] == 300 - 256
    assert res.outcomes["completed"] == 256


def test_vllm_queue_cap_refuses_with_503_and_no_retry_after():
    reqs = [SimRequest(f"q{i}", "gold", 0, 0.0, 4000, 500, 500, [], None, None, 1e6, 0) for i in range(100)]
    res = FleetSim(cfg(max_num_queued_reqs=10), VllmQueueCap(NAMES), NAMES).run(reqs)
    assert res.refused_by_reason["engine/queue_full"] == 100 - 20
    assert all(r.reason == "engine/queue_full" for r in reqs if r.outcome == "refused")


def test_dynamo_refuses_with_529_only_when_every_worker_is_busy():
    reqs = [SimRequest(f"q{i}", "gold", 0, i * 0.3, 4000, 1000, 1000, [], None, None, 1e6, 0) for i in range(40)]
    policy = DynamoBusy(NAMES, KV, 16, PROFILE.max_num_batched_tokens)
    res = FleetSim(cfg(), policy, NAMES).run(reqs)
    # 5,000 tokens = 313 blocks each; a worker is busy past 0.85 x 2,000 = 1,700 blocks: 6 fit each
    # (arrivals 0.3 s apart, so the prefill-token threshold does not bind first)
    assert res.outcomes["completed"] >= 12
    assert res.refused_by_reason["dynamo/all_workers_busy"] == res.outcomes["refused"] > 0


def test_llmd_refuses_sheddable_when_saturated_and_queues_the_rest():
    tenants = [tenant_config("gold", 10), tenant_config("free", -1)]
    policy = CorePolicy("llmd", core_config(tenants, 2, KV, 16, 8192, LLMD_POLICY))
    # arrivals spread over 1.2 s: llm-d reads scraped metrics as they are, so it sees saturation
    # only once a scrape (every 50 ms) shows it
    reqs = [SimRequest(f"f{i}", "free", -1, 0.5 + i * 0.02, 4000, 1000, 1000, [], None, None, 1e6, 0)
            for i in range(60)]
    reqs += [SimRequest(f"g{i}", "gold", 10, 0.8 + i * 1e-3, 4000, 100, 100, [], None, None, 1e6, 0)
             for i in range(20)]
    res = FleetSim(cfg(), policy, NAMES).run(reqs)
    assert res.refused_by_reason["flow/saturated"] > 0
    assert all(r.outcome == "completed" for r in reqs if r.tenant == "gold")  # held, then served


def test_clients_retry_after_the_retry_after_they_were_given():
    reqs = [SimRequest(f"q{i}", "gold", 0, 0.0, 4000, 200, 200, [], None, None, 1e6, 3) for i in range(300)]
    policy = TgiCap(NAMES)  # no Retry-After: exponential backoff
    sim = FleetSim(cfg(), policy, NAMES)
    res = sim.run(reqs)
    assert res.attempts > len(reqs)  # refused clients came back
    assert res.lost == 0


def test_capacity_is_the_saturated_completion_rate():
    tenants = [TenantSpec("gold", 0, 1.0, "t")]
    c1 = measure_capacity(cfg(), lambda: NoAdmission(NAMES), tenants, {"t": trace()}, seed=1, warmup_s=10,
                          measure_s=30)
    c2 = measure_capacity(cfg(), lambda: NoAdmission(NAMES), tenants, {"t": trace()}, seed=2, warmup_s=10,
                          measure_s=30)
    assert c1 > 1.0
    assert abs(c1 - c2) / c1 < 0.25  # a property of the fleet and mix, not of the seed


def test_load_factor_scales_the_offered_rate():
    tenants = [TenantSpec("a", 0, 0.25, "t"), TenantSpec("b", 0, 0.75, "t")]
    reqs = make_requests(tenants, {"t": trace()}, total_rate=20.0, duration_s=100, seed=0)
    assert len(reqs) == pytest.approx(2000, rel=0.02)
    assert sum(1 for r in reqs if r.tenant == "a") == pytest.approx(500, rel=0.05)
    again = make_requests(tenants, {"t": trace()}, total_rate=20.0, duration_s=100, seed=0)
    assert [(r.arrival, r.prompt_len) for r in again] == [(r.arrival, r.prompt_len) for r in reqs]
