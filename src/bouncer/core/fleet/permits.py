"""Permits: the admitted requests in flight, and what each holds on its replica.

A permit is granted at dispatch and held until the request ends. While held, its replica counts
it (requests, KV blocks, prefill tokens not yet computed, decode context: `ReplicaState.add`),
and so does its tenant (KV blocks, for tenant KV shares). Every permit is a lease: it lives until
`lease_until`, which the shell renews while it serves the request; one never renewed is
`expired`, for the core to reclaim.

In a disaggregated fleet a permit starts on the prefill worker, holding the prompt's blocks and
prefill, with the decode worker's ledger bound to hold the whole request from its predicted
arrival (`bouncer.core.fleet.decode_room`); when the prefill ends it is handed over (`hand_over`) and
held on the decode worker until the request ends.

`PermitStore` is what the core asks; `LocalPermits` keeps them in this process. The simulator's
baselines that keep their own in-flight view (a router deployed on its own) use the same store,
so every policy counts load the same way.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Protocol

from bouncer.core.fleet.blocks import num_blocks
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.requests import Admission


class PermitStore(Protocol):
    """Contract: `grant` then `release` of a request leaves its replica's and tenant's counts as
    they were before; `started` marks its prefill done (at most once; `release` does it if the
    request ended before a first token); `expired(now)` lists the permits whose lease ended
    before `now`, unrenewed; `renew` moves the lease of those it holds (others are ignored)."""

    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Admission]: ...
    def get(self, request_id: str) -> Admission | None: ...
    def grant(self, adm: Admission, replica: ReplicaState, now: float, lease_s: float,
              decode: ReplicaState | None = None) -> None: ...
    def hand_over(self, adm: Admission, replicas: dict[str, ReplicaState], now: float) -> None: ...
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

    def grant(self, adm: Admission, replica: ReplicaState, now: float, lease_s: float,
              decode: ReplicaState | None = None) -> None:
        """`adm.blocks` and `adm.prefill_tokens` are what it holds there (set by placement);
        `decode`: the decode worker that will hold it after `replica`, a prefill worker."""
        adm.replica = replica.name
        adm.dispatched_at = now
        adm.lease_until = now + lease_s
        replica.add(adm.request_id, adm, adm.blocks, adm.prefill_tokens)
        self._tenant_blocks[adm.tenant] += adm.blocks
        self._held[adm.request_id] = adm
        if decode is not None:
            decode.decode_ledger.bind(adm.request_id, adm.info.prompt_tokens,  # type: ignore[union-attr]
                                      adm.mean_output or adm.expected_output, now + (adm.ttft_predicted or 0.0))

    def hand_over(self, adm: Admission, replicas: dict[str, ReplicaState], now: float) -> None:
        """Its prefill ended: the permit moves from the prefill worker to its decode worker (at
        most once; a colocated request's is left where it is)."""
        if adm.decode_replica is None or adm.prefill_replica is not None or adm.request_id not in self._held:
            return
        prefill, decode = replicas[adm.replica], replicas[adm.decode_replica]  # type: ignore[index]
        prefill.mark_started(adm)
        prefill.remove(adm.request_id, adm.blocks)
        self._tenant_blocks[adm.tenant] -= adm.blocks
        adm.prefill_replica, adm.replica = prefill.name, decode.name
        adm.blocks = num_blocks(adm.info.prompt_tokens + adm.expected_output, decode.block_size)
        adm.prefill_tokens = 0  # its KV arrives computed
        decode.add(adm.request_id, adm, adm.blocks, 0)
        self._tenant_blocks[adm.tenant] += adm.blocks
        decode.decode_ledger.arrived(adm.request_id, now)  # type: ignore[union-attr]

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
        if adm.decode_replica is not None:
            replicas[adm.decode_replica].decode_ledger.release(adm.request_id)  # type: ignore[union-attr]
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
