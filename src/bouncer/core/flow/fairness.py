"""Fairness policies: which tenant of a band dispatches next, and the credit they keep.

Contract (checked for each in tests/conformance): `pick(band, skip, hold)` returns a queue of the
band that is non-empty and not in `skip`, or None when there is none; it may rotate the band's turn
order and move credit, but changes no queue. With `hold`, a tenant of `skip` had its turn and waits
for room for its head: the policy may then return None although others could go, so that the room
the head needs is not taken, bit by bit as it frees, by smaller requests of the others.
`charge(band, queue, adm)` is called when `adm`, that queue's head, is dispatched; `idle(band,
queue)` when the queue empties. Policies keep no state of their own: what they need between calls
(a tenant's deficit) lives in a `CreditStore`, keyed by (model, band, tenant), so that a shared
store can hold it for several gateways. Registered by name in `bouncer.core.registry`;
docs/policies/fairness-*.md.
"""

from __future__ import annotations

from typing import Protocol

from bouncer.core.flow.queues import Band, TenantQueue
from bouncer.core.requests import Admission

CreditKey = tuple[str, int, str]  # model, band, tenant


class CreditStore(Protocol):
    """Per (model, band, tenant) credit, in tokens. Contract: a key never set reads 0; `add`
    moves it by any amount, negative included; `reset` sets it back to 0."""

    def get(self, key: CreditKey) -> float: ...
    def add(self, key: CreditKey, amount: float) -> None: ...
    def reset(self, key: CreditKey) -> None: ...


class LocalCredit:
    def __init__(self) -> None:
        self._credit: dict[CreditKey, float] = {}

    def get(self, key: CreditKey) -> float:
        return self._credit.get(key, 0.0)

    def add(self, key: CreditKey, amount: float) -> None:
        self._credit[key] = self._credit.get(key, 0.0) + amount

    def reset(self, key: CreditKey) -> None:
        self._credit.pop(key, None)


class RoundRobin:
    """Equal turns: each tenant with waiting work dispatches one request per turn. A tenant
    whose turn it is and whose head waits for room (`hold`) keeps the turn: no one else goes."""

    name = "round-robin"

    def __init__(self, credit: CreditStore | None = None, quantum_tokens: int = 0) -> None:
        pass  # keeps no credit: the band's turn order is all it needs

    def pick(self, band: Band, skip: set[str], hold: bool = False) -> TenantQueue | None:
        if hold:
            return None
        for name in band.active:
            if name not in skip:
                return band.queues[name]
        return None

    def charge(self, band: Band, queue: TenantQueue, adm: Admission) -> None:
        band.active.remove(queue.tenant)
        band.active.append(queue.tenant)

    def idle(self, band: Band, queue: TenantQueue) -> None:
        pass


class WeightedDeficitRoundRobin:
    """Deficit round-robin in tokens (Shreedhar & Varghese): each turn adds
    `quantum x weight` tokens of credit; a tenant dispatches while its credit covers its head
    request's cost (prompt + expected output). Long-run token shares follow the weights; an idle
    tenant keeps no credit."""

    name = "wdrr"

    def __init__(self, credit: CreditStore, quantum_tokens: int) -> None:
        self.credit = credit
        self.quantum = quantum_tokens

    def pick(self, band: Band, skip: set[str], hold: bool = False) -> TenantQueue | None:
        """With `hold` (a tenant in `skip` had its turn and waits for room), the others spend
        only the credit they hold: no turn deals more until it has gone, so they get at most a
        quantum past it. Without this, their smaller requests take each bit of room as it frees
        and the tenant whose head needs more never gets its share: in the `gateways` scenario at
        load 2 on the live benchmark's engines (simulated), band 0's steady tenant was served 33%
        of its band's tokens through the other's burst, whose requests that went were half the
        size of its own (the smaller the prompt, the sooner it fits a prefill queue kept short for
        the top band); held, 45%."""
        candidates = [n for n in band.active if n not in skip]
        if not candidates:
            return None
        # Bounded: every pass adds credit to each candidate, so the cheapest head is covered
        # after at most max_cost / (quantum x min weight) passes.
        get, add = self.credit.get, self.credit.add
        model, priority, active = band.model, band.priority, band.active
        while True:
            for name in list(active):
                if name in skip:
                    continue
                q = band.queues[name]
                head = q.head()
                key = (model, priority, name)
                if head is not None and get(key) >= head.cost_tokens:
                    return q
                if hold:
                    continue
                add(key, self.quantum * q.weight)
                active.remove(name)
                active.append(name)
            if hold:
                return None

    def charge(self, band: Band, queue: TenantQueue, adm: Admission) -> None:
        self.credit.add((band.model, band.priority, queue.tenant), -adm.cost_tokens)

    def idle(self, band: Band, queue: TenantQueue) -> None:
        self.credit.reset((band.model, band.priority, queue.tenant))
