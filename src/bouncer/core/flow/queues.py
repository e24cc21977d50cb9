"""Flow control's waiting room: priority bands, per-tenant queues, and a TTL heap.

Three questions, three small policies (after llm-d's flow control):
- which band goes next: strict priority, higher integer first (here);
- which tenant inside the band: a `FairnessPolicy` (`bouncer.core.flow.fairness`);
- which request of that tenant: an `OrderingPolicy` (`bouncer.core.flow.ordering`).

The queues only hold and order; they never decide admission. One writer (the core) owns them.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import Protocol

from bouncer.core.flow.ordering import OrderingPolicy
from bouncer.core.requests import Admission

COMPACT_SLACK = 64  # a tenant queue's heap is rebuilt once its removed entries outnumber its live ones by this


class TenantQueue:
    """One tenant's requests in one band, in the ordering policy's order (a heap with lazy
    deletion, so removing a cancelled request is O(1))."""

    __slots__ = ("tenant", "weight", "ordering", "_heap", "_live", "count", "tokens")

    def __init__(self, tenant: str, weight: float, ordering: OrderingPolicy) -> None:
        self.tenant = tenant
        self.weight = weight
        self.ordering = ordering
        self._heap: list[tuple[tuple, Admission]] = []
        self._live: set[str] = set()
        self.count = 0
        self.tokens = 0

    def push(self, adm: Admission) -> None:
        heapq.heappush(self._heap, (self.ordering.key(adm), adm))
        self._live.add(adm.request_id)
        self.count += 1
        self.tokens += adm.info.prompt_tokens

    def head(self) -> Admission | None:
        heap = self._heap
        while heap and heap[0][1].request_id not in self._live:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def last_in_line(self, below_rank: int) -> list[Admission]:
        """Its requests of a rank below `below_rank` (a larger `Admission.queue_rank`), the lowest
        rank first and the newest first within a rank: those a request of that rank displaces
        from a full queue, in turn (O(n log n), only then)."""
        live = self._live
        return sorted((a for _, a in self._heap if a.request_id in live and a.queue_rank > below_rank),
                      key=lambda a: (a.queue_rank, a.seq), reverse=True)

    def would_lead(self, adm: Admission) -> bool:
        """Whether `adm`, pushed now, would be the head (keys are unique: they end in `seq`)."""
        return self.head() is None or self.ordering.key(adm) < self._heap[0][0]

    def remove(self, adm: Admission) -> None:
        self._live.discard(adm.request_id)
        self.count -= 1
        self.tokens -= adm.info.prompt_tokens
        if len(self._heap) > 2 * self.count + COMPACT_SLACK:
            # requests taken from the middle (dispatched past a held head, cancelled, expired)
            # leave their entries behind; without this the heap, and every scan of it, grows for
            # as long as the gateway runs
            self._rebuild()

    def reorder(self, ordering: OrderingPolicy) -> None:
        """Order by another policy from now on: every queued request's key is computed again."""
        self.ordering = ordering
        self._rebuild()

    def _rebuild(self) -> None:
        self._heap = [(self.ordering.key(a), a) for _, a in self._heap if a.request_id in self._live]
        heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Admission]:
        return (a for _, a in self._heap if a.request_id in self._live)

    def first(self, k: int) -> list[Admission]:
        """The next `k` requests in order (O(n log k))."""
        live = self._live
        return [a for _, a in heapq.nsmallest(k, (e for e in self._heap if e[1].request_id in live),
                                              key=lambda e: e[0])]


class Band:
    __slots__ = ("model", "priority", "queues", "active", "count", "tokens")

    def __init__(self, model: str, priority: int) -> None:
        self.model = model
        self.priority = priority
        self.queues: dict[str, TenantQueue] = {}
        self.active: deque[str] = deque()  # tenants with queued work, in turn order
        self.count = 0
        self.tokens = 0


class FairnessPolicy(Protocol):
    """Which tenant of a band dispatches next (`fairness` holds the policies and their contract)."""

    name: str

    def pick(self, band: Band, skip: set[str], hold: bool = False) -> TenantQueue | None: ...
    def charge(self, band: Band, queue: TenantQueue, adm: Admission) -> None: ...
    def idle(self, band: Band, queue: TenantQueue) -> None: ...


class FlowQueues:
    """All queued requests for one model: bands -> tenants -> requests, plus a TTL heap."""

    def __init__(self, model: str, fairness: FairnessPolicy, ordering: OrderingPolicy) -> None:
        self.model = model
        self.fairness = fairness
        self.ordering = ordering
        self.bands: dict[int, Band] = {}
        self._bands_desc: list[int] = []
        self._ttl: list[tuple[float, int, Admission]] = []
        self._queued: dict[str, Admission] = {}
        self.tokens = 0
        self.waiting_sessions: Counter[str] = Counter()  # agents with steps queued here: not idle

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queued

    def get(self, request_id: str) -> Admission | None:
        return self._queued.get(request_id)

    def bands_desc(self) -> list[Band]:
        return [self.bands[p] for p in self._bands_desc]

    def tenant_queue(self, adm: Admission) -> TenantQueue | None:
        return self.queue_of(adm.tenant, adm.priority)

    def queue_of(self, tenant: str, priority: int) -> TenantQueue | None:
        band = self.bands.get(priority)
        return band.queues.get(tenant) if band else None

    def reorder(self, ordering: OrderingPolicy) -> None:
        """A reload changed the ordering policy: queued requests are ordered by it at once."""
        self.ordering = ordering
        for band in self.bands.values():
            for q in band.queues.values():
                q.reorder(ordering)

    def push(self, adm: Admission, weight: float) -> None:
        band = self.bands.get(adm.priority)
        if band is None:
            band = self.bands[adm.priority] = Band(self.model, adm.priority)
            self._bands_desc = sorted(self.bands, reverse=True)
        q = band.queues.get(adm.tenant)
        if q is None:
            q = band.queues[adm.tenant] = TenantQueue(adm.tenant, weight, self.ordering)
        if q.count == 0:
            band.active.append(adm.tenant)
        q.push(adm)
        band.count += 1
        band.tokens += adm.info.prompt_tokens
        self.tokens += adm.info.prompt_tokens
        self._queued[adm.request_id] = adm
        if adm.session is not None:
            self.waiting_sessions[adm.session] += 1
            if adm.parent_session is not None:  # its parent waits on it: not idle either
                self.waiting_sessions[adm.parent_session] += 1
        heapq.heappush(self._ttl, (adm.deadline, adm.seq, adm))

    def remove(self, adm: Admission) -> bool:
        """Take a queued request out (dispatched, expired, refused, evicted, cancelled, or to
        move it to another band); False if it was not queued."""
        if self._queued.pop(adm.request_id, None) is None:
            return False
        if adm.session is not None:
            waiting = self.waiting_sessions
            for s in (adm.session, adm.parent_session):
                if s is not None:
                    waiting[s] -= 1
                    if not waiting[s]:
                        del waiting[s]
        band = self.bands[adm.priority]
        q = band.queues[adm.tenant]
        q.remove(adm)
        band.count -= 1
        band.tokens -= adm.info.prompt_tokens
        self.tokens -= adm.info.prompt_tokens
        if q.count == 0:
            band.active.remove(adm.tenant)
            self.fairness.idle(band, q)
        return True

    def expired(self, now: float) -> list[Admission]:
        out: dict[str, Admission] = {}  # a requeued request can have two heap entries
        ttl = self._ttl
        while ttl and ttl[0][0] <= now:
            _, _, adm = heapq.heappop(ttl)
            if adm.request_id in self._queued and adm.deadline <= now:  # (a re-pushed one may have a later TTL)
                out[adm.request_id] = adm
        return list(out.values())

    def next_deadline(self) -> float | None:
        ttl = self._ttl
        while ttl and ttl[0][2].request_id not in self._queued:
            heapq.heappop(ttl)
        return ttl[0][0] if ttl else None

    def lowest_sheddable(self, below: int, excluding: Sequence[Admission] = ()) -> Admission | None:
        """The request to evict for a newcomer of priority `below`: from the lowest sheddable
        band under it, the newest arrival (it has waited least); `excluding` those already
        chosen."""
        chosen = {a.request_id for a in excluding}
        for p in reversed(self._bands_desc):
            if p >= 0 or p >= below:
                return None
            band = self.bands[p]
            if band.count > sum(1 for a in excluding if a.priority == p):
                return max((a for q in band.queues.values() for a in q if a.request_id not in chosen),
                           key=lambda a: a.seq)
        return None

    def count_ahead(self, priority: int) -> int:
        """Queued requests in bands at or above `priority`: the backlog a newcomer waits behind."""
        n, bands = 0, self.bands
        for p in self._bands_desc:  # (highest first: a loop, as this runs several times per offer)
            if p < priority:
                break
            n += bands[p].count
        return n
