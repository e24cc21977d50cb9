"""Property tests: every offered request reaches exactly one terminal outcome, and every permit,
reserved block and queued token is given back."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bouncer.core.fleet.replica import Telemetry
from bouncer.core.outcomes import Dispatch, Reject, Terminal
from core_helpers import info, make_core, tenant

TENANTS = ["gold", "std", "free"]

op = st.one_of(
    st.tuples(st.just("offer"), st.sampled_from(TENANTS + ["nobody"]), st.integers(1, 3000),
              st.one_of(st.none(), st.integers(0, 3000)), st.one_of(st.none(), st.floats(0.1, 20))),
    st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
    st.tuples(st.just("observe"), st.integers(0, 2), st.floats(0, 1), st.integers(0, 20), st.booleans()),
    st.tuples(st.just("start"), st.integers(0, 10**6)),
    st.tuples(st.just("finish"), st.integers(0, 10**6),
              st.sampled_from([Terminal.COMPLETED, Terminal.FAILED, Terminal.CANCELLED]), st.integers(0, 500)),
    st.tuples(st.just("cancel"), st.integers(0, 10**6)),
    st.tuples(st.just("requeue"), st.integers(0, 10**6)),
    st.tuples(st.just("drain"), st.booleans()),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, max_size=120), st.sampled_from(["wdrr", "round-robin"]), st.sampled_from(["fcfs", "edf"]))
def test_every_request_ends_once_and_permits_return(ops, fairness, ordering):
    core = make_core(
        tenants=[tenant("gold", priority=5, kv_share=0.2, slo={"ttft_s": 1.0}),
                 tenant("std", rate_limit={"requests_per_s": 5}), tenant("free", priority=-1)],
        replicas=3, kv_blocks=400,
        policy={"fairness": fairness, "ordering": ordering, "queues": {"max_requests": 15, "tenant_max_requests": 8},
                "drain_queue_cap": 4, "breaker": {"failures": 3}})
    now = 0.0
    offered: list[str] = []
    terminal: dict[str, int] = {}
    inflight: list[str] = []
    queued: set[str] = set()

    def apply(events):
        for e in events:
            if isinstance(e, Dispatch):
                assert e.request_id in queued or e.request_id == last_offer
                queued.discard(e.request_id)
                inflight.append(e.request_id)
            else:
                assert isinstance(e, Reject)
                queued.discard(e.request_id)
                terminal[e.request_id] = terminal.get(e.request_id, 0) + 1

    last_offer = None
    for o in ops:
        kind = o[0]
        if kind == "offer":
            r = info(o[1], prompt=o[2], max_tokens=o[3], ttl_s=o[4])
            offered.append(r.request_id)
            last_offer = r.request_id
            queued.add(r.request_id)
            apply(core.offer(r, now))
        elif kind == "advance":
            now += o[1]
            apply(core.tick(now))
        elif kind == "observe":
            name = list(core.replicas)[o[1]]
            tele = Telemetry(at=now, kv_usage=o[2], running=3, waiting=o[3]) if o[4] else None
            apply(core.observe(name, tele, now))
        elif kind == "start" and inflight:
            core.started(inflight[o[1] % len(inflight)], now)
        elif kind == "finish" and inflight:
            rid = inflight.pop(o[1] % len(inflight))
            terminal[rid] = terminal.get(rid, 0) + 1
            reason = "upstream_timeout" if o[2] is Terminal.FAILED else None
            apply(core.finished(rid, now, o[2], completion_tokens=o[3], reason=reason))
        elif kind == "requeue" and inflight:
            rid = inflight.pop(o[1] % len(inflight))
            queued.add(rid)
            last_offer = rid
            apply(core.requeue(rid, now))
        elif kind == "cancel" and queued:
            rid = sorted(queued)[o[1] % len(queued)]
            queued.discard(rid)
            terminal[rid] = terminal.get(rid, 0) + 1
            apply(core.cancel(rid, now))
        elif kind == "drain":
            if o[1]:
                core.drain("m")
            else:
                apply(core.undrain("m", now))
    # Wind down: undrain, finish everything admitted, let every TTL pass.
    apply(core.undrain("m", now))
    for _ in range(1000):
        while inflight:
            rid = inflight.pop()
            terminal[rid] = terminal.get(rid, 0) + 1
            apply(core.finished(rid, now, Terminal.COMPLETED, completion_tokens=1))
        if not queued:
            break
        now += 1.0
        for name in core.replicas:
            apply(core.observe(name, Telemetry(at=now, kv_usage=0.0, running=0, waiting=0), now))
        apply(core.tick(now))
    assert not queued and not inflight
    assert set(terminal) == set(offered)
    assert all(n == 1 for n in terminal.values()), "a request ended twice"
    assert core.stats.offered == len(offered) == sum(core.stats.outcomes.values())
    assert core.view.queued == 0 and not core.view.inflight
    for r in core.replicas.values():
        assert r.inflight_blocks == 0 and not r.inflight and r.unstarted == 0 and r.queued_prefill_tokens == 0 \
            and r.queued_prefill_pairs == 0
        assert r.blocks_since_sample == 0
    assert all(core.permits.tenant_blocks(t) == 0 for t in ("gold", "std", "free"))
    for ms in core.models.values():
        assert ms.flow.tokens == 0 and all(b.count == 0 and b.tokens == 0 for b in ms.flow.bands.values())
