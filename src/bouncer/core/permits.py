"""Permits: the admitted requests in flight, and what each holds on its replica.

A permit is granted at dispatch and held until the request ends. While held, its replica counts
it (requests, KV blocks, prefill tokens not yet computed, decode context: `ReplicaState.add`),
and so does its tenant (KV blocks, for tenant KV shares). Every permit is a lease: it lives until
`lease_until`, which the shell renews while it serves the request; one never renewed is
`expired`, for the core to reclaim.

`PermitStore` is what the core asks; `LocalPermits` keeps them in this process. The simulator's
baselines that keep their own in-flight view (a router deployed on its own) use the same store,
so every policy counts load the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Protocol

from bouncer.core.fleet import ReplicaState
from bouncer.core.requests import Admission


class PermitStore(Protocol):
    """Contract: `grant` then `release` of a request leaves its replica's and tenant's counts as
    they were before; `started` marks its prefill done (at most once; `release` does it if the
    request ended before a first token); `expired(now)` lists the permits whose lease ended
    before `now`, unrenewed; `renew` moves the lease of those it holds (others are ignored)."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Admission]: ...
    def get(self, request_id: str) -> Admission | None: ...
    def grant(self, adm: Admission, replica: ReplicaState, now: float, lease_s: float) -> None: ...
    def started(self, adm: Admission, replica: ReplicaState, now: float) -> None: ...
    def release(self, request_id: str, replicas: dict[str, ReplicaState]) -> Admission | None: ...
    def renew(self, request_ids: Iterable[str], until: float) -> None: ...
    def expired(self, now: float) -> list[Admission]: ...
    def tenant_blocks(self, tenant: str) -> int: ...


class LocalPermits:
    def __init__(self) -> None:
        self._held: dict[str, Admission] = {}
        self._tenant_blocks: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Admission]:
        return iter(list(self._held.values()))

    def get(self, request_id: str) -> Admission | None:
        return self._held.get(request_id)

    def grant(self, adm: Admission, replica: ReplicaState, now: float, lease_s: float) -> None:
        """`adm.blocks` and `adm.prefill_tokens` are what it holds there (set by placement)."""
        adm.replica = replica.name
        adm.dispatched_at = now
        adm.lease_until = now + lease_s
        replica.add(adm.request_id, adm, adm.blocks, adm.prefill_tokens)
        self._tenant_blocks[adm.tenant] += adm.blocks
        self._held[adm.request_id] = adm

    def started(self, adm: Admission, replica: ReplicaState, now: float) -> None:
        if adm.first_token_at is None:
            adm.first_token_at = now
            replica.mark_started(adm)

    def release(self, request_id: str, replicas: dict[str, ReplicaState]) -> Admission | None:
        adm = self._held.pop(request_id, None)
        if adm is None:
            return None
        replica = replicas[adm.replica]  # type: ignore[index]
        if adm.first_token_at is None:
            replica.mark_started(adm)
        replica.remove(adm.request_id, adm.blocks)
        self._tenant_blocks[adm.tenant] -= adm.blocks
        return adm

    def renew(self, request_ids: Iterable[str], until: float) -> None:
        for rid in request_ids:
            adm = self._held.get(rid)
            if adm is not None:
                adm.lease_until = until

    def expired(self, now: float) -> list[Admission]:
        return [adm for adm in self._held.values() if adm.lease_until < now]

    def tenant_blocks(self, tenant: str) -> int:
        return self._tenant_blocks[tenant]
