"""A tenant's queue: order kept, and no growth from requests taken out of its middle."""

from __future__ import annotations

from bouncer.core.flow.ordering import FCFS
from bouncer.core.flow.queues import COMPACT_SLACK, TenantQueue
from bouncer.core.requests import Admission
from core_helpers import info


def _adm(seq: int) -> Admission:
    return Admission(info(), "a", 0, 10, 10, arrival=0.0, deadline=60.0, ttft_deadline=None, seq=seq)


def test_requests_leaving_from_the_middle_do_not_grow_the_queue():
    q = TenantQueue("a", 1.0, FCFS())
    head = _adm(0)
    q.push(head)
    for seq in range(1, 20_001):  # a held head while 20,000 others pass it (dispatched or cancelled)
        adm = _adm(seq)
        q.push(adm)
        q.remove(adm)
    assert q.count == 1 and q.head() is head and q.first(3) == [head]
    assert len(q._heap) <= 2 * q.count + COMPACT_SLACK + 1


def test_order_survives_compaction():
    q = TenantQueue("a", 1.0, FCFS())
    adms = [_adm(seq) for seq in range(500)]
    for adm in reversed(adms):
        q.push(adm)
    for adm in adms[1::2]:  # every other one leaves: the heap is rebuilt on the way
        q.remove(adm)
    assert q.first(250) == adms[0::2] and q.count == 250
