"""Every registered fairness, ordering and saturation policy passes the contract its interface
states (bouncer/core/flow/fairness.py, ordering.py, saturation.py). A new policy registered in
bouncer.core.registry is picked up here by name."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from bouncer.config import Policy
from bouncer.core import registry
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.replica import ReplicaState, Telemetry
from bouncer.core.flow.fairness import LocalCredit
from bouncer.core.flow.queues import FlowQueues
from bouncer.core.requests import STEP_ACTIVE, STEP_OTHER, STEP_RETURNING, Admission, RequestInfo

_seq = itertools.count()


def adm(tenant: str, prompt: int = 100, ttft_deadline: float | None = None, deadline: float = 60.0,
        rank: int = STEP_OTHER) -> Admission:
    n = next(_seq)
    return Admission(RequestInfo(f"q{n}", None, "m", prompt, 10), tenant, 0, 10, 10, arrival=0.0, deadline=deadline,
                     ttft_deadline=ttft_deadline, seq=n, queue_rank=rank)


QUANTUM = 4096


def flow_with(fairness_name: str, tenants: dict[str, int], weights: dict[str, float] | None = None):
    fairness = registry.make_fairness(fairness_name, LocalCredit(), QUANTUM)
    flow = FlowQueues("m", fairness, registry.make_ordering("fcfs"))
    for name, n in tenants.items():
        for _ in range(n):
            flow.push(adm(name), (weights or {}).get(name, 1.0))
    return flow


def serve(flow: FlowQueues, picks: int, skip: set[str] = frozenset(), hold: bool = False) -> Counter:
    served: Counter = Counter()
    band = flow.bands[0]
    for _ in range(picks):
        q = flow.fairness.pick(band, set(skip), hold)
        if q is None:
            break
        head = q.head()
        flow.fairness.charge(band, q, head)
        flow.remove(head)
        served[q.tenant] += 1
    return served


@pytest.mark.parametrize("name", registry.names("fairness"))
class TestFairness:
    def test_pick_returns_a_non_empty_queue_not_skipped_or_none(self, name):
        flow = flow_with(name, {"a": 3, "b": 3})
        band = flow.bands[0]
        q = flow.fairness.pick(band, {"a"})
        assert q is not None and q.tenant == "b" and q.count > 0
        assert flow.fairness.pick(band, {"a", "b"}) is None
        counts = {t: band.queues[t].count for t in band.queues}
        flow.fairness.pick(band, set())
        assert {t: band.queues[t].count for t in band.queues} == counts  # pick changes no queue

    def test_a_held_turn_lets_others_go_only_on_what_they_hold(self, name):
        # `a` had its turn and waits for room: with `hold`, no new turn is dealt to the others
        flow = flow_with(name, {"a": 100, "b": 100})
        band = flow.bands[0]
        first = flow.fairness.pick(band, set())
        assert first is not None
        served = serve(flow, 100, skip={first.tenant}, hold=True)
        assert served[first.tenant] == 0
        # b goes at most on the credit it was dealt before: under a quantum's worth of requests
        assert sum(served.values()) * 110 <= QUANTUM
        assert flow.fairness.pick(band, {first.tenant}, hold=True) is None  # a quantum's worth, then it waits
        assert flow.fairness.pick(band, {first.tenant}) is not None  # not held: the others go

    def test_equal_weights_and_costs_get_equal_service_and_none_starves(self, name):
        # equal within one turn's worth: a request (round-robin) or a quantum of tokens (deficit
        # round-robin serves a tenant's credit in one go)
        flow = flow_with(name, {"a": 400, "b": 400, "c": 400})
        served = serve(flow, 600)
        cost = 110  # prompt 100 + expected output 10
        assert set(served) == {"a", "b", "c"}
        assert (max(served.values()) - min(served.values())) * cost <= QUANTUM + 2 * cost, served

    def test_an_emptied_queue_is_idle_and_starts_afresh(self, name):
        flow = flow_with(name, {"a": 1, "b": 500})
        serve(flow, 100)  # a's queue empties
        assert "a" not in flow.bands[0].active
        flow.push(adm("a"), 1.0)
        served = serve(flow, 2 * (QUANTUM // 110 + 1))
        assert served["a"] == 1  # back within a turn or two of the others: no debt carried


@pytest.mark.parametrize("name", registry.names("ordering"))
class TestOrdering:
    def test_keys_are_stable_and_distinct(self, name):
        policy = registry.make_ordering(name)
        requests = [adm("a", ttft_deadline=d) for d in (5.0, 1.0, 1.0, None)]
        keys = [policy.key(r) for r in requests]
        assert keys == [policy.key(r) for r in requests] and len(set(keys)) == len(keys)

    def test_agents_steps_come_first_active_then_returning(self, name):
        policy = registry.make_ordering(name)
        other = adm("a", ttft_deadline=0.1)
        returning = adm("a", ttft_deadline=50.0, rank=STEP_RETURNING)
        active = adm("a", ttft_deadline=90.0, rank=STEP_ACTIVE)
        assert sorted([other, returning, active], key=policy.key) == [active, returning, other]

    def test_ties_go_by_arrival(self, name):
        policy = registry.make_ordering(name)
        first, second = adm("a", ttft_deadline=3.0), adm("a", ttft_deadline=3.0)
        assert policy.key(first) < policy.key(second)


def _pool(usages: list[float | None], fail_open: bool = False) -> PoolView:
    replicas = {}
    for i, u in enumerate(usages):
        r = ReplicaState(f"r{i}", "m", None, 1000, 16)
        if u is None:
            r.healthy = False
        else:
            r.observe(Telemetry(at=0.0, kv_usage=u, running=0, waiting=0))
        replicas[r.name] = r
    on_stale = "fail-open" if fail_open else "fail-closed"
    return PoolView(replicas, Policy(telemetry={"on_stale": on_stale}), 0.5)


@pytest.mark.parametrize("name", registry.names("saturation detector"))
class TestSaturation:
    def test_it_is_a_number_that_grows_with_load(self, name):
        detector = registry.make_saturation(name, Policy())
        values = [detector.saturation(_pool([u, u])) for u in (0.0, 0.3, 0.6, 0.9, 1.0)]
        assert values == sorted(values) and values[0] >= 0 and values[-1] >= 1.0

    def test_a_replica_it_cannot_see_counts_as_saturated(self, name):
        detector = registry.make_saturation(name, Policy())
        assert detector.saturation(_pool([None, None])) >= 1.0
        assert detector.saturation(_pool([None, 0.0])) > detector.saturation(_pool([0.0, 0.0]))


def test_every_registered_policy_has_its_page():
    import pathlib
    pages = pathlib.Path(__file__).resolve().parents[2] / "docs" / "policies"
    prefixes = {"fairness": "fairness", "ordering": "ordering", "saturation detector": "saturation", "router": "router"}
    for kind, prefix in prefixes.items():
        for name in registry.names(kind):
            page = pages / f"{prefix}-{name}.md"
            assert page.is_file(), page
            text = page.read_text()
            for section in ("What it does", "What it reads", "Configuration", "Trade-offs", "Fail open or closed"):
                assert f"**{section}.**" in text, (page, section)
