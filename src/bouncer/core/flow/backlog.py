"""How long a newcomer would wait: the backlog ahead of it over the rate it is being served.

Three rates, each over a recent window, kept by a `BacklogStore` (in this process,
`LocalBacklog`; shared, a store several gateways write):
- dispatches from the waiting room: how fast a queued backlog is served (`queue_wait`, what SLO
  feasibility uses at arrival);
- departures from the waiting room, by any way (dispatched, expired, refused as late, evicted,
  cancelled): how soon the backlog ahead has gone (`turnover_wait`, what Retry-After falls back on);
- completions of the fleet: a slower, steadier rate, for when the waiting room has none
  (`estimated_wait`).

Retry-After says when a refused tenant next gets in: from how long its recent refusals took to
be answered where it has some (`bouncer.core.flow.comebacks`), else from these rates
(`retry_after`).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.flow.comebacks import Comebacks
from bouncer.core.flow.queues import FlowQueues
from bouncer.core.outcomes import RETRY_AFTER_MIN_S
from bouncer.core.sharing.peers import FleetShares

DISPATCH_WINDOW_S = 10.0  # dispatches and departures the waiting room's rates are measured over
MIN_DISPATCHES_FOR_RATE = 10  # fewer in the window: no estimate
SERVICE_RATE_WINDOW_S = 30.0  # completions used to estimate how fast the fleet drains a backlog
MIN_COMPLETIONS_FOR_RATE = 10  # fewer in the window: no estimate (no refusal on a guess)
RETRY_AFTER_MAX_S = 60.0


class BacklogStore(Protocol):
    """Event times per model, and their recent rates (per second; None with too few to tell)."""

    def note_dispatch(self, model: str, now: float) -> None: ...
    def note_departure(self, model: str, now: float) -> None: ...
    def note_completion(self, model: str, now: float) -> None: ...
    def dispatch_rate(self, model: str, now: float) -> float | None: ...
    def departure_rate(self, model: str, now: float) -> float | None: ...
    def completion_rate(self, model: str, now: float) -> float | None: ...


def _rate(times: deque[float], now: float, window: float, minimum: int) -> float | None:
    """Events per second over the last `window` of `times` (trimmed as it goes)."""
    while times and times[0] < now - window:
        times.popleft()
    if len(times) < minimum:
        return None
    return len(times) / max(1.0, now - times[0])


class LocalBacklog:
    def __init__(self) -> None:
        self._dispatches: dict[str, deque[float]] = {}
        self._departures: dict[str, deque[float]] = {}
        self._completions: dict[str, deque[float]] = {}

    @staticmethod
    def _times(by_model: dict[str, deque[float]], model: str) -> deque[float]:
        times = by_model.get(model)
        if times is None:
            times = by_model[model] = deque()
        return times

    def note_dispatch(self, model: str, now: float) -> None:
        self._times(self._dispatches, model).append(now)

    def note_departure(self, model: str, now: float) -> None:
        self._times(self._departures, model).append(now)

    def note_completion(self, model: str, now: float) -> None:
        times = self._times(self._completions, model)
        times.append(now)
        while times and times[0] < now - SERVICE_RATE_WINDOW_S:
            times.popleft()

    def dispatch_rate(self, model: str, now: float) -> float | None:
        return _rate(self._times(self._dispatches, model), now, DISPATCH_WINDOW_S, MIN_DISPATCHES_FOR_RATE)

    def departure_rate(self, model: str, now: float) -> float | None:
        return _rate(self._times(self._departures, model), now, DISPATCH_WINDOW_S, MIN_DISPATCHES_FOR_RATE)

    def completion_rate(self, model: str, now: float) -> float | None:
        return _rate(self._times(self._completions, model), now, SERVICE_RATE_WINDOW_S, MIN_COMPLETIONS_FOR_RATE)


def ahead(flow: FlowQueues, priority: int, tenant: str | None, unqueued: int = 0) -> float:
    """Queued requests a newcomer waits behind: all of the higher bands, and in its own band
    its tenant's queue, which under fair queueing drains at the tenant's weighted share of
    the band (so a tenant flooding its band waits long while a light one does not).
    `unqueued`: requests of `tenant` counted in its queue, which holds some already, that are
    not in it (a newcomer judged before it is queued: `Arrivals._enter_waiting_room`)."""
    n: float = flow.count_ahead(priority + 1)
    band = flow.bands.get(priority)
    if band is not None and band.count:
        q = band.queues.get(tenant) if tenant is not None else None
        if q is None or not q.count:
            n += band.count
        else:
            # the tenants with queued work (`Band.active`), not every tenant the band has seen
            # (a plain loop: this runs two or three times per arrival, over one tenant or a few)
            queues, active = band.queues, 0.0
            for name in band.active:
                active += queues[name].weight
            n += (q.count + unqueued) * active / q.weight
    return n


def fleet_ahead(flow: FlowQueues, priority: int, tenant: str | None, peers: FleetShares) -> float:
    """`ahead`, counting what the other gateways queue too: across gateways the fleet is served in
    one order (`bouncer.core.sharing.peers`), so a newcomer waits behind their backlog as well as this
    gateway's. A tenant queued only elsewhere, never here, counts with weight 1."""
    model = flow.model
    n: float = flow.count_ahead(priority + 1) + peers.queued_above_elsewhere(model, priority)
    band = flow.bands.get(priority)
    weights = {name: band.queues[name].weight for name in band.active} if band is not None else {}
    count = band.count if band is not None else 0
    q = band.queues.get(tenant) if band is not None and tenant is not None else None
    mine = q.count if q is not None else 0
    for other, queued in peers.queued_elsewhere(model, priority):
        count += queued
        if other == tenant:
            mine += queued
        if other not in weights:
            known = band.queues.get(other) if band is not None else None
            weights[other] = known.weight if known is not None else 1.0
    if count:
        n += mine * sum(weights.values()) / weights.get(tenant, 1.0) if mine else count  # type: ignore[arg-type]
    return n


class Backlog:
    """The wait estimates of one model's waiting room."""

    def __init__(self, model: str, flow: FlowQueues, replicas: dict[str, ReplicaState], store: BacklogStore,
                 peers: FleetShares | None = None) -> None:
        self.model = model
        self.flow = flow
        self.replicas = replicas
        self.store = store
        self.peers = peers  # with several gateways: their queues and rates count too
        self.comebacks = Comebacks()  # each tenant's refusals at this gateway, until answered

    def _ahead(self, priority: int, tenant: str | None, unqueued: int = 0) -> float:
        peers = self.peers
        if peers is None or not peers.enabled:
            return ahead(self.flow, priority, tenant, unqueued)
        assert not unqueued, "judged before it is queued only where gateways share nothing"
        return fleet_ahead(self.flow, priority, tenant, peers)

    def _rate(self, own: float | None, which: int) -> float | None:
        """This gateway's rate, plus the other gateways' where they share theirs."""
        peers = self.peers
        if peers is None or not peers.enabled:
            return own
        total = (own or 0.0) + peers.rates_elsewhere(self.model)[which]
        return total or None

    def queue_wait(self, priority: int, now: float, tenant: str, unqueued: int = 0) -> float | None:
        """How long a newcomer would wait in the gateway's queue before its dispatch: the
        backlog ahead of it over the rate the queue has been dispatching.

        Not corrected online, unlike TTFT and TPOT, on purpose: under sustained overload some of
        that backlog expires instead of being served, so observed waits run shorter than this
        (median 0.87x in `surge` at load 2). Learning that admits more requests, more of which
        then expire after waiting out their budget, instead of being refused at once: measured,
        goodput in `surge` at load 3 fell from 41.4 to 34.7 req/s."""
        rate = self._rate(self.store.dispatch_rate(self.model, now), 0)
        return None if rate is None else self._ahead(priority, tenant, unqueued) / rate

    def turnover_wait(self, priority: int, now: float, tenant: str | None) -> float | None:
        """How long until the backlog ahead of a newcomer has left the waiting room, by any way:
        when a request sent again would reach the head. Shorter than `queue_wait` under
        overload, where much of the backlog leaves without being served."""
        rate = self._rate(self.store.departure_rate(self.model, now), 1)
        return None if rate is None else self._ahead(priority, tenant) / rate

    def estimated_wait(self, priority: int, now: float, tenant: str | None = None, unqueued: int = 0) -> float | None:
        """How long a new request of this priority would wait to start, over the rate the
        model's replicas have been completing requests (None until there is a rate). Ahead of
        it: the gateway's backlog, and what was dispatched but has not started in its band and
        above (lower bands go after it)."""
        rate = self._rate(self.store.completion_rate(self.model, now), 2)
        if rate is None:
            return None
        unstarted = sum(r.unstarted_at_or_above(priority) for r in self.replicas.values())
        return (self._ahead(priority, tenant, unqueued) + unstarted) / rate

    def retry_after(self, priority: int, now: float, tenant: str | None = None, late: float = 0.0,
                    behind_backlog: bool = False) -> float:
        """A request of this priority and tenant is refused now: when one sent again would be let
        through. How long its tenant's refusals lately took to be answered (`Comebacks`, which
        follows this one too), else once the backlog ahead of it has left the waiting room
        (`turnover_wait`), else over the rate the fleet completes requests, else a second or so
        while there is no rate yet; and then no sooner than `late`, how late this one was
        predicted to start. `behind_backlog`: a sheddable band refused while the pool is
        saturated, which gets in once the backlog above it has turned over: no sooner than
        that (its own refusals lately answered quickly say nothing of how long this saturation
        lasts: in rogue-tenant at load 3 the free tier was told 6 s where 21 s passed, 0.29x;
        with the turnover 0.59x, and in flood 1.01x against 0.84x). Checked against what
        happened in the simulator: `bench run` reports, per refusal reason, the ratio of this
        to the time until a request of the tenant sent after it got in."""
        wait = self.comebacks.refused(tenant, now) if tenant is not None else None
        if wait is not None and behind_backlog:
            wait = max(wait, self.turnover_wait(priority, now, tenant) or 0.0)
        if wait is None:
            wait = self.turnover_wait(priority, now, tenant) if tenant is not None else None
            if wait is None:
                wait = self.estimated_wait(priority, now, tenant)
            if wait is None:
                wait = RETRY_AFTER_MIN_S + len(self.flow) * 0.05
            wait = max(wait, late)
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, wait))
