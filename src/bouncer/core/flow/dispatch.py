"""Dispatch: queued requests go, highest band first, while the pool has room for them.

A band dispatches only while the pool's saturation is under its ceiling, and one that still has
queued work blocks the bands below it: their requests would take the room it waits for. Inside a
band the fairness policy picks the tenant; that tenant's head goes where placement puts it, or
waits, and the next tenant may still fit, on the credit it holds while that head waits for room
(`policy.fair_hold_s`). An agent's step that its window or its home replica
holds lets another agent's go (`next_agent_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from bouncer.config import Policy
from bouncer.core.agents.gate import AgentGate, WindowGate
from bouncer.core.fleet.blocks import num_blocks
from bouncer.core.fleet.permits import PermitStore
from bouncer.core.fleet.placement import Held, HeldForRoom, Late, Placement, kv_limit
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.flow.queues import FlowQueues, TenantQueue
from bouncer.core.flow.saturation import SaturationDetector, ceiling
from bouncer.core.learning import feedback
from bouncer.core.model_state import ModelState
from bouncer.core.outcomes import Dispatch, Event
from bouncer.core.requests import Admission
from bouncer.core.sharing.peers import FleetShares, urgency
from bouncer.core.sharing.prefixes import SentPrefixes

if TYPE_CHECKING:
    from bouncer.core.finaliser import CoreStats, Finaliser

AGENT_LOOKAHEAD = 16  # queued requests of a tenant looked at for an agent step that may go now

Placed = tuple[ReplicaState, dict[str, int]] | Late | Held


class Dispatcher:
    """Runs one model's dispatch loop; `grant` and `on_late` are the core's (they settle
    permits and ends), so that this module only decides the order. `grant` is given the
    replica's KV usage before the request and the usage its band may fill it to (`kv_limit`)."""

    def __init__(self, placement: Placement, saturation: SaturationDetector,
                 grant: Callable[[Admission, ReplicaState, dict[str, int], float, float, float], Dispatch],
                 on_late: Callable[[Admission, float, float], list[Event]],
                 acts_on_late: Callable[[Admission], bool], shares: FleetShares) -> None:
        self.placement = placement
        self.shares = shares
        self.saturation = saturation
        self.grant = grant
        self.on_late = on_late
        self.acts_on_late = acts_on_late

    def run(self, ms: ModelState, now: float, view: PoolView | None = None) -> list[Event]:
        """`view`: the pool as the calling entry point already sees it at `now`, if it built one."""
        events: list[Event] = []
        ms.looped_at = now
        flow: FlowQueues = ms.flow
        if ms.draining or not len(flow):
            return events
        if view is None:
            view = PoolView(ms.replicas, self.placement.policy, now)
        agents: AgentGate = ms.agents
        windowed = isinstance(agents, WindowGate)
        if windowed:
            agents.expire(now, flow.waiting_sessions)
        for band in flow.bands_desc():
            if not band.count:
                continue
            limit = ceiling(self.placement.policy, band.priority)
            protected = ms.band_slos.protected(band.priority, now)  # the same for every request of the band
            kv = kv_limit(self.placement.policy, band.priority, protected)
            skip: set[str] = set()
            held_for_room = HeldForRoom()
            hold = False  # a tenant whose turn it was waits for room for its head (`_holds_room`)
            shared = self.shares.enabled
            if shared and self.shares.outranked(band.model, band.priority):
                break  # a higher band waits at another gateway: this one and those below leave it the room
            while band.count:
                if self.saturation.saturation(view) >= limit:
                    break
                q = flow.fairness.pick(band, skip, hold)
                if q is None:
                    break
                adm = q.head()
                agent_step = windowed and adm.session is not None
                if shared and self.shares.holds((band.model, band.priority, q.tenant),
                                                None if agent_step else urgency(adm), now):
                    skip.add(q.tenant)
                    continue
                if agent_step:
                    # the head is an agent's step: if the window or its replica holds it, another
                    # agent's may go (agents of one tenant do not wait behind each other)
                    step = self.next_agent_step(ms, q, agents, view, protected, kv)
                    if step is None:
                        skip.add(q.tenant)
                        continue
                    adm, placed = step
                else:
                    placed = self.placement.place(ms.cfg, ms.replicas, adm, view, protected, kv, agents,
                                                  self.acts_on_late(adm), held_for_room)
                if isinstance(placed, Late):
                    events.extend(self.on_late(adm, now, placed.by_s))
                    continue
                if isinstance(placed, Held):
                    skip.add(q.tenant)  # its head waits; other tenants may still fit...
                    if placed is Held.ROOM and not agent_step:
                        hold = self._holds_room(adm, now) or hold  # ...on credit they hold
                    continue
                flow.fairness.charge(band, q, adm)
                replica, cached = placed
                events.append(self.grant(adm, replica, cached, now, view.usage(replica), kv))
                view.granted(replica)
            if band.count:
                break
        return events

    def _holds_room(self, adm: Admission, now: float) -> bool:
        """Whether `adm`, its tenant's turn, still holds its band's room while it waits for it
        (`policy.fair_hold_s` since it first found none): the others of the band then go only on
        credit they hold (`FairnessPolicy.pick`). Bounded, as a head may need more room than its
        replicas will free soon (a prompt whose prefill alone nearly fills a higher band's TTFT
        reserve), and the band's other tenants would wait on it meanwhile."""
        if adm.room_wait_since is None:
            adm.room_wait_since = now
        return now - adm.room_wait_since < self.placement.policy.fair_hold_s

    def next_agent_step(self, ms: ModelState, q: TenantQueue, agents: WindowGate, view: PoolView,
                        protected: tuple[float, float], kv: float) -> tuple[Admission, Placed] | None:
        """The first of the tenant's next requests that may go, and where. An active agent's step
        is passed over while the window pauses it, its fan-out is at the cap, or its replica is
        full. Agents waiting for a slot (returning, then new) take one in their order: passing
        over one whose context does not fit yet for a smaller one behind it starves agents of
        long contexts. Measured in the `agents` scenario: the sessions that then completed were
        12-24% longer than the trace's mean, because sessions that start from a long context
        are short (24 steps on average against 63 for the others)."""
        waiting = ms.flow.waiting_sessions
        in_line = False  # an agent waiting for a slot could not have one: those behind it wait too
        for adm in q.first(AGENT_LOOKAHEAD):
            newcomer = agents.is_newcomer(adm)
            if newcomer and in_line:
                continue
            if adm.session is None or agents.may_dispatch(adm, view.now, waiting):
                placed = self.placement.place(ms.cfg, ms.replicas, adm, view, protected, kv, agents,
                                              self.acts_on_late(adm))
                if not isinstance(placed, Held):
                    return adm, placed
            in_line = in_line or newcomer
        return None


def blocks_and_prefill(adm: Admission, replica: ReplicaState, cached: dict[str, int]) -> None:
    """What it will hold there: KV blocks for its prompt and expected output, and the prompt
    tokens the replica does not hold yet (its prefill work)."""
    output = 0 if replica.role == "prefill" else adm.expected_output  # decoded elsewhere
    adm.blocks = num_blocks(adm.info.prompt_tokens + output, replica.block_size)
    adm.prefill_tokens = adm.info.prompt_tokens - cached[replica.name]


def dispatch_event(adm: Admission, replica: ReplicaState, now: float) -> Dispatch:
    ttft = tpot = None
    if replica.latency is not None and adm.ttft_raw is not None and adm.tpot_raw is not None:
        ttft = adm.ttft_raw * replica.latency.ttft_factor
        tpot = adm.tpot_raw * replica.latency.tpot_factor
    return Dispatch(adm.request_id, replica.name, adm.info.model, adm.tenant, adm.priority, adm.max_tokens,
                    adm.arrival, now, ttft, tpot, adm.predicted_infeasible, adm.decode_replica,
                    cache_salt=adm.info.cache_salt)


def grant(adm: Admission, replica: ReplicaState, cached: dict[str, int], ms: ModelState, finaliser: Finaliser,
          permits: PermitStore, policy: Policy, stats: CoreStats, now: float,
          sent: SentPrefixes | None = None) -> Dispatch:
    """It goes to `replica` now: out of the waiting room, its permit granted there. `sent`: where
    this gateway logs the blocks it is first to send there, while it shares state."""
    finaliser.dispatched(adm, ms.flow, now)
    blocks_and_prefill(adm, replica, cached)
    ms.demand.dispatched(adm.info.prompt_tokens, adm.prefill_tokens, now)
    feedback.at_dispatch(adm, replica, now)
    digests = adm.info.block_digests
    held = adm.first_new_block = replica.prefix.record(digests, now)
    if sent is not None and held < len(digests):
        sent.sent(replica.name, digests[held:], now)
    decode = ms.replicas[adm.decode_replica] if adm.decode_replica is not None else None
    permits.grant(adm, replica, now, policy.permit_lease_s, decode)
    if adm.session is not None and isinstance(ms.agents, WindowGate):
        ms.agents.dispatched(adm, now)
    stats.note("admitted", "-", "-", adm.tenant, adm.priority)
    return dispatch_event(adm, replica, now)
