"""Flow control's waiting room: priority bands, per-tenant queues, fairness and ordering.

Three questions, three small policies (after llm-d's flow control):
- which band goes next: strict priority, higher integer first;
- which tenant inside the band: a `FairnessPolicy` (round-robin in turns, or weighted deficit
  round-robin in *tokens*, so a tenant of long prompts cannot crowd out one of short chats);
- which request of that tenant: an `OrderingPolicy` (FCFS, or earliest deadline first).

The queues only hold and order; they never decide admission. One writer (the core) owns them.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterator
from typing import Protocol

from bouncer.core.requests import Admission

DISPATCH_WINDOW_S = 10.0  # dispatches the queue's service rate is measured over
MIN_DISPATCHES_FOR_RATE = 10  # fewer in the window: no estimate
COMPACT_SLACK = 64  # a tenant queue's heap is rebuilt once its removed entries outnumber its live ones by this


class OrderingPolicy(Protocol):
    """Orders one tenant's queued requests. `key` must not change while a request is queued.
    Agents' steps come first under either policy, by `queue_rank` (active, then returning agents)."""

    name: str

    def key(self, adm: Admission) -> tuple: ...


class FCFS:
    name = "fcfs"

    def key(self, adm: Admission) -> tuple:
        return (adm.queue_rank, adm.seq)


class EarliestDeadline:
    """TTFT deadline when the request has one, else its queue TTL; ties by arrival."""

    name = "edf"

    def key(self, adm: Admission) -> tuple:
        deadline = adm.ttft_deadline if adm.ttft_deadline is not None else adm.deadline
        return (adm.queue_rank, deadline, adm.seq)


def _rate(times: deque[float], now: float) -> float | None:
    """Events per second over the last DISPATCH_WINDOW_S of `times` (trimmed as it goes); None
    with too few to tell."""
    while times and times[0] < now - DISPATCH_WINDOW_S:
        times.popleft()
    if len(times) < MIN_DISPATCHES_FOR_RATE:
        return None
    return len(times) / max(1.0, now - times[0])


class TenantQueue:
    """One tenant's requests in one band, in the ordering policy's order (a heap with lazy
    deletion, so removing a cancelled request is O(1))."""

    __slots__ = ("tenant", "weight", "ordering", "_heap", "_live", "count", "tokens", "deficit")

    def __init__(self, tenant: str, weight: float, ordering: OrderingPolicy) -> None:
        self.tenant = tenant
        self.weight = weight
        self.ordering = ordering
        self._heap: list[tuple[tuple, Admission]] = []
        self._live: set[str] = set()
        self.count = 0
        self.tokens = 0
        self.deficit = 0.0

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

    def remove(self, adm: Admission) -> None:
        self._live.discard(adm.request_id)
        self.count -= 1
        self.tokens -= adm.info.prompt_tokens
        if len(self._heap) > 2 * self.count + COMPACT_SLACK:
            # requests taken from the middle (dispatched past a held head, cancelled, expired)
            # leave their entries behind; without this the heap, and every scan of it, grows for
            # as long as the gateway runs
            self._heap = [e for e in self._heap if e[1].request_id in self._live]
            heapq.heapify(self._heap)

    def __iter__(self) -> Iterator[Admission]:
        return (a for _, a in self._heap if a.request_id in self._live)

    def first(self, k: int) -> list[Admission]:
        """The next `k` requests in order (O(n log k))."""
        live = self._live
        return [a for _, a in heapq.nsmallest(k, (e for e in self._heap if e[1].request_id in live),
                                              key=lambda e: e[0])]


class FairnessPolicy(Protocol):
    """Picks the next tenant queue of a band. `pick` may update its own bookkeeping (deficits,
    turn order) but must return a queue that is non-empty and not in `skip`; `charge` is called
    when that queue's head is dispatched."""

    name: str

    def pick(self, band: Band, skip: set[str]) -> TenantQueue | None: ...

    def charge(self, band: Band, queue: TenantQueue, adm: Admission) -> None: ...


class RoundRobin:
    """Equal turns: each tenant with waiting work dispatches one request per turn."""

    name = "round-robin"

    def pick(self, band: Band, skip: set[str]) -> TenantQueue | None:
        for name in band.active:
            if name not in skip:
                return band.queues[name]
        return None

    def charge(self, band: Band, queue: TenantQueue, adm: Admission) -> None:
        band.active.remove(queue.tenant)
        band.active.append(queue.tenant)


class WeightedDeficitRoundRobin:
    """Deficit round-robin in tokens (Shreedhar & Varghese): each turn adds
    `quantum x weight` tokens of credit; a tenant dispatches while its credit covers its head
    request's cost (prompt + expected output). Long-run token shares follow the weights."""

    name = "wdrr"

    def __init__(self, quantum_tokens: int) -> None:
        self.quantum = quantum_tokens

    def pick(self, band: Band, skip: set[str]) -> TenantQueue | None:
        candidates = [n for n in band.active if n not in skip]
        if not candidates:
            return None
        # Bounded: every pass adds credit to each candidate, so the cheapest head is covered
        # after at most max_cost / (quantum x min weight) passes.
        while True:
            for name in list(band.active):
                if name in skip:
                    continue
                q = band.queues[name]
                head = q.head()
                if head is not None and q.deficit >= head.cost_tokens:
                    return q
                q.deficit += self.quantum * q.weight
                band.active.remove(name)
                band.active.append(name)

    def charge(self, band: Band, queue: TenantQueue, adm: Admission) -> None:
        queue.deficit -= adm.cost_tokens


class Band:
    __slots__ = ("priority", "queues", "active", "count", "tokens")

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.queues: dict[str, TenantQueue] = {}
        self.active: deque[str] = deque()  # tenants with queued work, in turn order
        self.count = 0
        self.tokens = 0


class FlowQueues:
    """All queued requests for one model: bands -> tenants -> requests, plus a TTL heap."""

    def __init__(self, fairness: FairnessPolicy, ordering: OrderingPolicy) -> None:
        self.fairness = fairness
        self.ordering = ordering
        self.bands: dict[int, Band] = {}
        self._bands_desc: list[int] = []
        self._ttl: list[tuple[float, int, Admission]] = []
        self._queued: dict[str, Admission] = {}
        self.tokens = 0
        self._dispatches: deque[float] = deque()  # when queued requests were dispatched, recently
        self._departures: deque[float] = deque()  # when queued requests left, by any way, recently
        self.waiting_sessions: Counter[str] = Counter()  # agents with steps queued here: not idle

    def dispatched(self, now: float) -> None:
        self._dispatches.append(now)

    def dispatch_rate(self, now: float) -> float | None:
        """Requests per second dispatched from the waiting room recently: the rate at which a
        newcomer's backlog is served (None with too few to tell)."""
        return _rate(self._dispatches, now)

    def departure_rate(self, now: float) -> float | None:
        """Requests per second that left the waiting room recently, dispatched or not."""
        return _rate(self._departures, now)

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queued

    def get(self, request_id: str) -> Admission | None:
        return self._queued.get(request_id)

    def bands_desc(self) -> list[Band]:
        return [self.bands[p] for p in self._bands_desc]

    def tenant_queue(self, adm: Admission) -> TenantQueue | None:
        band = self.bands.get(adm.priority)
        return band.queues.get(adm.tenant) if band else None

    def push(self, adm: Admission, weight: float) -> None:
        band = self.bands.get(adm.priority)
        if band is None:
            band = self.bands[adm.priority] = Band(adm.priority)
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
        heapq.heappush(self._ttl, (adm.deadline, adm.seq, adm))

    def remove(self, adm: Admission, now: float | None) -> None:
        """Take a queued request out; `now` when it leaves the waiting room (dispatched, expired,
        refused, evicted or cancelled), None when it is only moved (demoted to another band)."""
        if self._queued.pop(adm.request_id, None) is None:
            return
        if now is not None and adm.arrival < now:  # (one refused as it arrived was never part of a backlog)
            self._departures.append(now)
        if adm.session is not None:
            self.waiting_sessions[adm.session] -= 1
            if not self.waiting_sessions[adm.session]:
                del self.waiting_sessions[adm.session]
        band = self.bands[adm.priority]
        q = band.queues[adm.tenant]
        q.remove(adm)
        band.count -= 1
        band.tokens -= adm.info.prompt_tokens
        self.tokens -= adm.info.prompt_tokens
        if q.count == 0:
            band.active.remove(adm.tenant)
            q.deficit = 0.0  # DRR: an idle flow keeps no credit

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

    def lowest_sheddable(self, below: int) -> Admission | None:
        """The request to evict for a newcomer of priority `below`: from the lowest sheddable
        band under it, the newest arrival (it has waited least)."""
        for p in reversed(self._bands_desc):
            if p >= 0 or p >= below:
                return None
            band = self.bands[p]
            if band.count:
                return max((a for q in band.queues.values() for a in q), key=lambda a: a.seq)
        return None

    def count_ahead(self, priority: int) -> int:
        """Queued requests in bands at or above `priority`: the backlog a newcomer waits behind."""
        return sum(self.bands[p].count for p in self._bands_desc if p >= priority)
