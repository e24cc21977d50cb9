"""A request kept to a subset of the replicas (an endpoint picker's subset hint) is placed only
there, and waits for room there rather than going elsewhere."""

from __future__ import annotations

from bouncer.core.fleet.replica import Telemetry
from core_helpers import dispatched, info, make_core, tenant


def test_a_request_kept_to_a_subset_goes_only_there_and_waits_for_it():
    core = make_core(tenants=[tenant("a"), tenant("b")])
    names = sorted(core.replicas)
    only = frozenset(names[1:])
    placed = [d.replica for _ in range(4) for d in dispatched(core.offer(info(replicas=only), 0.0))]
    assert placed and set(placed) == set(only)
    # its replica full, the other idle: a kept request waits, another tenant's free one goes to
    # the idle replica (a kept head holds up its own tenant's queue behind it, as any head does)
    core.observe(names[1], Telemetry(at=1.0, kv_usage=1.0, running=0, waiting=0), 1.0)
    assert dispatched(core.offer(info(replicas=only), 1.0)) == []
    assert [d.replica for d in dispatched(core.offer(info("b"), 1.0))] == [names[0]]
    assert core.view.queued == 1
