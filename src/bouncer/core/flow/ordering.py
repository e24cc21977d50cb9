"""Ordering policies: which of one tenant's queued requests goes first.

Contract (checked for each in tests/conformance): `key(adm)` is a tuple compared ascending, the
smallest first; it depends only on the request's own fields and must not change while the request
is queued (the queue is a heap of keys). Agents' steps come first under every policy, by
`queue_rank` (an active agent's, then a returning agent's, then the rest). Registered by name in
`bouncer.core.registry`; docs/policies/ordering-*.md.
"""

from __future__ import annotations

from typing import Protocol

from bouncer.core.requests import Admission


class OrderingPolicy(Protocol):
    name: str

    def key(self, adm: Admission) -> tuple: ...


class FCFS:
    """First come, first served."""

    name = "fcfs"

    def key(self, adm: Admission) -> tuple:
        return (adm.queue_rank, adm.seq)


class EarliestDeadline:
    """TTFT deadline when the request has one, else its queue TTL; ties by arrival."""

    name = "edf"

    def key(self, adm: Admission) -> tuple:
        deadline = adm.ttft_deadline if adm.ttft_deadline is not None else adm.deadline
        return (adm.queue_rank, deadline, adm.seq)
