"""Several gateways in front of one simulated fleet, each with its own admission core.

As behind a Kubernetes Service, clients are spread over the gateways: `request` spreads each
attempt on its own (a new connection each time, kube-proxy picking a gateway at random; a retry
may reach another gateway), except an agent's steps, which keep their session's gateway (one
client, one kept-alive connection); `tenant` puts each tenant's traffic on one gateway (tenant i
on gateway i mod N), the case where fairness across gateways is hardest.

Each gateway scrapes every replica and hears every replica's KV events itself. What they share:
- nothing (`delay_s` None): N independent gateways, each counting only its own requests in
  flight, enforcing every limit on its own, as llm-d's active-active mode does;
- or, as several Bouncer gateways on Redis do: one rate-limit store and one retry ledger (each
  request's verdict is one atomic call there, so no staleness is modelled, only sharing), and
  every `sync_s` each gateway's part of the fleet's load and tenants' service
  (`bouncer.core.sharing.peers`), seen by the others `delay_s` later; and a dispatch to a nearly full
  replica claims it first (`bouncer.core.sharing.claims`), checked at once against what the others hold.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from bouncer.core.fleet.replica import Telemetry
from bouncer.core.outcomes import Claim
from bouncer.core.sharing import claims
from bouncer.core.sharing.peers import GatewayShare
from bouncer.core.stores import Stores
from bouncer.sim.fleet import PolicyEvent, SimRequest
from bouncer.sim.policies import CorePolicy

SPREADS = ("request", "tenant")
SYNC_S = 0.02  # as the gateway's Redis link publishes (`gateway.shared_state`)


@dataclass(frozen=True)
class GatewaySetup:
    """How many gateways, whether and how late they share state, and how clients reach them."""

    count: int = 1
    delay_s: float | None = None  # None: independent gateways, nothing shared
    spread: str = "request"
    sync_s: float = SYNC_S

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError("gateways must be at least 1")
        if self.spread not in SPREADS:
            raise ValueError(f"unknown spread {self.spread!r}; known: {', '.join(SPREADS)}")
        if self.delay_s is not None and self.delay_s < 0:
            raise ValueError("the shared state's delay cannot be negative")

    @property
    def shared(self) -> bool:
        return self.delay_s is not None

    def describe(self) -> dict:
        return {"count": self.count, "shared": self.shared, "state_delay_ms": None if self.delay_s is None
                else self.delay_s * 1000, "spread": self.spread}


class Gateways:
    """A `GatewayPolicy` made of N cores; `make(stores)` builds one gateway's `CorePolicy`."""

    def __init__(self, setup: GatewaySetup, make: Callable[[Stores | None], CorePolicy]) -> None:
        self.setup = setup
        shared = Stores.local()
        self.gateways: list[CorePolicy] = []
        for _ in range(setup.count):
            stores = None
            if setup.shared:
                own = Stores.local()
                stores = Stores(own.permits, shared.rate_limits, own.credit, shared.retries, own.backlog)
            self.gateways.append(make(stores))
        if setup.shared:
            for i, g in enumerate(self.gateways):
                g.claimer = functools.partial(self._claim, i)
        self.name = self.gateways[0].name
        self._tenants: dict[str, int] = {}  # tenant -> its gateway, for spread "tenant"
        self._sessions: dict[str, int] = {}
        self._at: dict[str, int] = {}  # attempt id -> the gateway holding it
        self._next_sync = 0.0 if setup.shared else float("inf")
        self._deliveries: list[tuple[float, int, list[GatewayShare]]] = []  # (visible at, seq, shares by gateway)
        self._seq = itertools.count()

    @property
    def core(self):
        """The first gateway's core (what a run's recording samples)."""
        return self.gateways[0].core

    @property
    def replica_names(self) -> list[str]:
        return self.gateways[0].replica_names

    @property
    def queued(self) -> int:
        return sum(g.queued for g in self.gateways)

    def _gateway_for(self, req: SimRequest) -> int:
        n = self.setup.count
        if self.setup.spread == "tenant":
            if req.tenant not in self._tenants:
                self._tenants[req.tenant] = len(self._tenants) % n
            return self._tenants[req.tenant]
        if req.session is not None:
            key = req.parent_session or req.session
            if key not in self._sessions:
                self._sessions[key] = zlib.crc32(key.encode()) % n
            return self._sessions[key]
        return zlib.crc32(req.attempt_id.encode()) % n

    def _of(self, attempt_id: str) -> CorePolicy | None:
        i = self._at.get(attempt_id)
        return None if i is None else self.gateways[i]

    # -- GatewayPolicy ------------------------------------------------------------------------------
    def offer(self, req: SimRequest, now: float) -> list[PolicyEvent]:
        i = self._gateway_for(req)
        self._at[req.attempt_id] = i
        return self.gateways[i].offer(req, now)

    def tick(self, now: float) -> list[PolicyEvent]:
        events = self._sync(now)
        for g in self.gateways:
            wake = g.next_wakeup()
            if wake is not None and wake <= now:
                events.extend(g.tick(now))
        return events

    def next_wakeup(self) -> float | None:
        wakes = [w for g in self.gateways if (w := g.next_wakeup()) is not None]
        wakes.append(self._next_sync)
        if self._deliveries:
            wakes.append(self._deliveries[0][0])
        return min(wakes)

    def started(self, attempt_id, now):
        g = self._of(attempt_id)
        if g is not None:
            g.started(attempt_id, now)

    def handed_over(self, attempt_id, now):
        g = self._of(attempt_id)
        return g.handed_over(attempt_id, now) if g is not None else []

    def finished(self, attempt_id, now, completed, completion_tokens):
        g = self._of(attempt_id)
        self._at.pop(attempt_id, None)
        return g.finished(attempt_id, now, completed, completion_tokens) if g is not None else []

    def cancel(self, attempt_id, now):
        g = self._of(attempt_id)
        self._at.pop(attempt_id, None)
        return g.cancel(attempt_id, now) if g is not None else []

    def engine_refused(self, attempt_id, now):
        g = self._of(attempt_id)
        return g.engine_refused(attempt_id, now) if g is not None else []

    def observe(self, replica: str, telemetry: Telemetry, now: float):
        return [e for g in self.gateways for e in g.observe(replica, telemetry, now)]

    def kv_events(self, replica, stored, removed, now) -> None:
        for g in self.gateways:
            g.kv_events(replica, stored, removed, now)

    # -- the shared state ---------------------------------------------------------------------------
    def _claim(self, i: int, replica: str, claim: Claim) -> int | None:
        """Gateway `i`'s claim (`bouncer.core.sharing.claims`), atomic and at once (its round trip is not
        modelled): what the others hold on the replica is their own count of it now."""
        others = 0
        for j, g in enumerate(self.gateways):
            if j != i:
                r = g.core.replicas[replica]
                others += r.inflight_blocks - r.peers.blocks
        return None if claims.holds(claim, others) else others

    def _sync(self, now: float) -> list[PolicyEvent]:
        """Publish every gateway's part when a sync period is due; deliver what has become
        visible: each gateway sees the others' parts."""
        if now >= self._next_sync:
            self._next_sync = now + self.setup.sync_s
            shares = [g.core.own_share(now) for g in self.gateways]
            heapq.heappush(self._deliveries, (now + self.setup.delay_s, next(self._seq), shares))
        events: list[PolicyEvent] = []
        while self._deliveries and self._deliveries[0][0] <= now:
            _, _, shares = heapq.heappop(self._deliveries)
            for i, g in enumerate(self.gateways):
                others = shares[:i] + shares[i + 1:]
                events.extend(g.peers(others, now))
        return events
