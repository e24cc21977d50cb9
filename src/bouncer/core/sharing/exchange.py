"""What this gateway hands the others and takes from them (`bouncer.core.sharing.peers` holds the parts
and the fleet-wide order): its part gathered from the models and replicas, and the others'
spread back over them. The core's `own_share` and `peers` are these, on its own state."""

from __future__ import annotations

from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.flow.backlog import BacklogStore
from bouncer.core.intake.breaker import CircuitBreaker
from bouncer.core.model_state import ModelState
from bouncer.core.sharing.peers import NO_LOAD, FleetShares, GatewayShare, ReplicaLoad, urgency
from bouncer.core.sharing.prefixes import PeerPrefixes, SentPrefixes


def own_share(models: dict[str, ModelState], replicas: dict[str, ReplicaState], shares: FleetShares,
              backlog: BacklogStore, breakers: dict[str, CircuitBreaker], sent: SentPrefixes, hold_s: float,
              now: float) -> GatewayShare:
    """Its load on each replica, what it served per tenant and band, the heads and counts it
    queues (and of those, the heads that had their turn and wait for room, for up to `hold_s`),
    its waiting room's rates, its bands' recent SLOs, its tenants' breakers (those refusing or
    counting failures), the agents holding a slot here, and the blocks it was first to send to
    each replica lately."""
    queued = {}
    room = []
    for m, ms in models.items():
        for band in ms.flow.bands.values():
            for t in band.active:
                q = band.queues[t]
                head = q.head()
                queued[(m, band.priority, t)] = (urgency(head) - now, q.count)
                since = head.room_wait_since  # type: ignore[union-attr]
                if since is not None and now - since < hold_s:
                    room.append((m, band.priority, t))
    rates = {m: (backlog.dispatch_rate(m, now), backlog.departure_rate(m, now), backlog.completion_rate(m, now))
             for m in models}
    bands = {m: ms.band_slos.own(now) for m, ms in models.items()}
    tripped = {t: state for t, b in breakers.items() if (state := b.share(now)) != (None, 0)}
    agents = {}
    for m, ms in models.items():
        if ms.agents.window is not None:
            ms.agents.expire(now, ms.flow.waiting_sessions)  # an agent idled out here no longer holds a slot
            agents[m] = ms.agents.window.own_agents()
    return GatewayShare({name: r.own_load() for name, r in replicas.items()}, shares.own(now), queued, rates, bands,
                        tripped, agents, sent.recent(now), room)


def take_peers(models: dict[str, ModelState], replicas: dict[str, ReplicaState], shares: FleetShares,
               breakers: dict[str, CircuitBreaker], prefixes: PeerPrefixes, others: list[GatewayShare],
               now: float) -> None:
    """The others' parts, as last seen, in every replica's figures, the fleet-wide order, the
    bands' SLOs, the tenants' breakers, the agent windows and the prefix indexes; from now on
    the dispatch loop follows them (`FleetShares.enabled`) and this gateway logs what it sends."""
    shares.enabled = True
    loads: dict[str, ReplicaLoad] = {}
    for share in others:
        for name, load in share.replicas.items():
            loads[name] = loads[name] + load if name in loads else load
    for name, r in replicas.items():
        r.set_peers(loads.get(name, NO_LOAD), now)
    shares.seen(others, now)
    for m, ms in models.items():
        ms.band_slos.seen_elsewhere([b for share in others for b in share.bands.get(m, ())], now)
        if ms.agents.window is not None:
            ms.agents.window.seen_elsewhere([a for share in others for a in share.agents.get(m, ())])
    for share in others:
        prefixes.take(share.prefixes, replicas, now)
    for tenant, breaker in breakers.items():  # the longest any other refuses it for; their failures summed
        states = [share.breakers[tenant] for share in others if tenant in share.breakers]
        waits = [w for w, _ in states if w is not None]
        breaker.seen_elsewhere(max(waits) if waits else None, sum(n for _, n in states), now)
