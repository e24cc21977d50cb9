"""The admission core: for each request, admit it now, hold it, or shed it.

Pure and synchronous: every entry point takes `now` (seconds, any monotonic origin) and returns
the decisions it made as events (`bouncer.core.outcomes`). No IO, no clock, no sleeping; the
asyncio gateway and the virtual-time simulator drive the very same object.

Entry points (those that decide return `list[Event]`):
- `offer(info, now)`: a new request, through the layers in order (`offer` reads as the table in
  docs/concepts/architecture.md). Refused at the first layer that refuses it, else queued; it may be
  dispatched at once (a `Dispatch` event for it) or later.
- `tick(now)`: expire queued requests past their TTL, reclaim lost permits, dispatch what now
  fits. Call it at `next_wakeup()` at the latest.
- `started(id, now)`: first token seen. `finished(id, now, terminal, ...)`: the request is over;
  its permit returns and room may open. `requeue(id, now)`: a backend refused it for load.
  `unclaimed(id, others, now)`: its claim on a nearly full replica failed (`bouncer.core.sharing.claims`).
- `cancel(id, now)`: the client left while queued. `observe(replica, telemetry, now)`: a scrape.
  `kv_events` / `kv_digests`: an engine's prefix-cache changes. `renew(ids, now)`: the shell still
  serves these. `drain(model)` / `undrain(model)`: model swaps. `reload(config, now)`.
  `observe_pressure(name, value, at)`: an outside signal's value (`bouncer.core.intake.pressure`).
- `own_share(now)` / `peers(others, now)`: with several gateways, this one's part of the state
  they share, and the others' as last seen (`bouncer.core.sharing.peers`).
- `view`: what the shells may read (`bouncer.core.view`).

This class holds only the entry points and the glue between the parts: a new request's layers
run in `arrivals`, each layer lives in its own module (intake, deadlines, waiting_room, dispatch,
placement, saturation, feedback, backlog, agent_gate), every end goes through `finaliser`, and
the state lives in `stores`. One writer: the shell calls these from one thread (the event loop).
"""

from __future__ import annotations

from collections.abc import Iterable

from bouncer.config import BouncerConfig, ModelConfig, Tenant
from bouncer.core.agents.gate import WindowGate, make_gate
from bouncer.core.arrivals import Arrivals, Exemption
from bouncer.core.finaliser import UNKNOWN_TENANT, CoreStats, Finaliser
from bouncer.core.fleet.kv_events import KVEvent
from bouncer.core.fleet.placement import Placement, nowhere_to_go, rest
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.replica import ReplicaState, Telemetry
from bouncer.core.flow.dispatch import Dispatcher, grant
from bouncer.core.flow.queues import FlowQueues
from bouncer.core.flow.waiting_room import leave
from bouncer.core.intake import checks
from bouncer.core.intake.pressure import PressureSignal, reconfigured
from bouncer.core.intake.tenant_book import TenantBook
from bouncer.core.learning import feedback
from bouncer.core.model_state import ModelState, next_wakeup
from bouncer.core.outcomes import Dispatch, Event, Layer, Reason, Refusal, Reject, Terminal
from bouncer.core.registry import make_fairness, make_ordering, make_router, make_saturation
from bouncer.core.requests import Admission, RequestInfo
from bouncer.core.sharing import claims, exchange
from bouncer.core.sharing.peers import FleetShares, GatewayShare
from bouncer.core.sharing.prefixes import PeerPrefixes, SentPrefixes
from bouncer.core.stores import Stores
from bouncer.core.view import CoreView


class AdmissionCore:
    def __init__(self, config: BouncerConfig, now: float, stores: Stores | None = None,
                 exemption: Exemption | None = None, decodes_from_engines: bool = False) -> None:
        """`exemption`: for paired benchmark runs only (`bench feasibility`), one request
        admitted even when predicted to miss its deadline; never set in production.
        `decodes_from_engines`: the shell reads no answer past its first token (the endpoint
        picker's buffered setup), so decode speed is learned from the engines' own inter-token
        latency instead."""
        self.stores = stores or Stores.local()
        self.permits = self.stores.permits
        self.stats = CoreStats()
        self.models: dict[str, ModelState] = {}
        self.replicas: dict[str, ReplicaState] = {}
        self.tenants = TenantBook(self.stores.rate_limits)
        self.pressures: dict[str, PressureSignal] = {}  # outside signals by name (`observe_pressure`)
        self.finaliser = Finaliser(self.stats, self.permits, self.stores.rate_limits, self.stores.backlog,
                                   self.tenants.breakers, self.replicas, self.models)
        self.gate = checks.TenantGate(self.stores.rate_limits)
        self.arrivals = Arrivals(self, exemption)
        self._next_lease_check = now
        self._routing_cfg = None
        self.shares = FleetShares(config.policy.fleet_shares_window_s, config.policy.fleet_shares_slack_tokens)
        self.sent_prefixes, self.peer_prefixes = SentPrefixes(), PeerPrefixes()  # used while state is shared
        self.decodes_from_engines = decodes_from_engines
        self.view = CoreView(self)
        self.reload(config, now)

    # -- configuration ------------------------------------------------------------------------
    def reload(self, config: BouncerConfig, now: float) -> list[Event]:
        """Apply a new config without touching queued or in-flight requests: every policy it
        names is built first, then swapped in; queues re-order at once under a new ordering
        policy. A router's state (turns, trees) survives reloads that keep its settings; a
        tenant's rate limits and breaker restart only when their settings change; replicas no
        longer listed finish their work and get nothing new."""
        p = config.policy
        router = make_router(p.routing.router, p.routing) if p.routing != self._routing_cfg else self.placement.router
        fairness = make_fairness(p.fairness, self.stores.credit, p.wdrr_quantum_tokens)
        ordering = make_ordering(p.ordering)
        self.saturation = make_saturation(p.saturation.detector, p)
        self.config, self.policy, self._routing_cfg = config, p, p.routing
        self.shares.window_s, self.shares.slack = p.fleet_shares_window_s, p.fleet_shares_slack_tokens
        self.finaliser.retries = self.stores.retries if p.retries.deadline == "first-attempt" else None
        self.finaliser.overflow.reconfigure(config, now)
        self.stores.retries.remember_s, self.stores.retries.max_entries = p.retries.remember_s, p.retries.max_remembered
        self.pressures = reconfigured(self.pressures, config.pressure)
        self.tenants.reconfigure(config, now)
        self.placement = Placement(p, router, self.tenants.by_name, self.permits)
        self.dispatcher = Dispatcher(self.placement, self.saturation, self._grant, self.arrivals.late,
                                     self.arrivals.acts_on_late, self.shares)
        for m in config.models:
            ms = self.models.get(m.name)
            if ms is None:
                ms = self.models[m.name] = ModelState(m, FlowQueues(m.name, fairness, ordering), self.stores.backlog,
                                                      self.shares)
            ms.reconfigure(m, config, fairness, ordering, self.stores.credit, make_gate(p, ms.agents), self.replicas)
        return self.tick(now)

    def set_backends(self, model: ModelConfig, now: float) -> list[Event]:
        """A model's replicas as its discovery found them (the shell's finders,
        `bouncer.gateway.discovery`): new ones entered, gone ones finish their work and get
        nothing new; nothing else of the config changes."""
        self.config = self.config.with_model(model)
        ms = self.models[model.name]
        ms.cfg = model
        ms.sync_replicas(self.policy, self.replicas)
        return self.tick(now)

    # -- a new request, layer by layer (`bouncer.core.arrivals`) ------------------------------------
    def precheck(self, info: RequestInfo, now: float) -> Reject | Tenant:
        """A new request's cheap layers, before its prompt is tokenized (`prompt_tokens` and its
        blocks are not read): who it is, its model, its tenant's breaker and rate limits (looked
        at, not taken: `offer` takes them), the waiting room's doors; its arrival counted. A
        flood that these refuse costs the gateway no tokenizing. Returns the refusal, or the
        tenant for `offer`, which runs this itself when not given one."""
        return self.arrivals.precheck(info, now)[0]

    def offer(self, info: RequestInfo, now: float, checked: Tenant | None = None) -> list[Event]:
        """A new request, layer by layer; `checked`: its tenant as `precheck` found it, where the
        shell ran that first (else it runs here)."""
        return self.arrivals.offer(info, now, checked)

    def _grant(self, adm: Admission, replica: ReplicaState, cached: dict[str, int], now: float,
               usage: float, kv_limit: float) -> Dispatch:
        """`usage`: the replica's KV usage before it, as placement saw it; `kv_limit`: what its
        band may fill the replica to."""
        if not self.shares.enabled:
            return grant(adm, replica, cached, self.models[adm.info.model], self.finaliser, self.permits, self.policy,
                         self.stats, now)
        self.shares.served((adm.info.model, adm.priority, adm.tenant),
                           adm.cost_tokens / self.tenants.weight(adm.tenant), now)
        d = grant(adm, replica, cached, self.models[adm.info.model], self.finaliser, self.permits, self.policy,
                  self.stats, now, self.sent_prefixes)
        claim = claims.claim_for(adm, replica, cached[replica.name], usage, kv_limit)
        return d if claim is None else d._replace(claim=claim)

    # -- lifecycle of admitted requests -------------------------------------------------------
    def started(self, request_id: str, now: float, measured: bool = True) -> None:
        """Its first token came at `now`; `measured=False`: its whole answer came then (not
        streamed), so its prefill is over but when it ended is not known."""
        adm = self.permits.get(request_id)
        if adm is None or adm.first_token_at is not None:
            return
        r = self.replicas[adm.replica]  # type: ignore[index]
        r.streamed_at = now
        prefill = self.replicas[adm.prefill_replica] if adm.prefill_replica is not None else None
        feedback.first_token(adm, r, self.models[adm.info.model], now, measured, prefill)
        self.permits.started(adm, r, now)

    def handed_over(self, request_id: str, now: float) -> list[Event]:
        """Disaggregated: its prefill ended, and its KV goes to its decode worker (the prefill
        worker's room is freed for what waits)."""
        adm = self.permits.get(request_id)
        if adm is None or adm.decode_replica is None:
            return []
        self.permits.hand_over(adm, self.replicas, now)
        return self.dispatcher.run(self.models[adm.info.model], now)

    def finished(self, request_id: str, now: float, terminal: Terminal, completion_tokens: int | None = 0,
                 reason: str | None = None) -> list[Event]:
        """The admitted request is over. `reason` for FAILED names the failure (a Reason, e.g.
        "upstream_timeout"). `completion_tokens` None: the shell did not see the answer (an
        endpoint picker that let it pass), so nothing is learnt from its length or timing. Unknown
        ids are ignored, so a shell may call this from every exit path."""
        adm = self.finaliser.finish(request_id, terminal, reason, now, completion_tokens)
        if adm is None:
            return []
        ms = self.models[adm.info.model]
        if adm.session is not None and isinstance(ms.agents, WindowGate):
            ms.agents.finished(adm, now)
        if terminal is Terminal.COMPLETED:
            self._learn(ms, adm, now, completion_tokens)
        return self.dispatcher.run(ms, now)

    def _learn(self, ms: ModelState, adm: Admission, now: float, completion_tokens: int | None) -> None:
        replica = self.replicas[adm.replica]  # type: ignore[index]
        replica.streamed_at = now
        self.stats.served_tokens[adm.tenant] += adm.info.prompt_tokens + (completion_tokens or 0)
        self.stores.backlog.note_completion(adm.info.model, now)
        if completion_tokens is None:  # unseen: its length and timing teach nothing
            return
        ms.demand.completed(adm.tenant, adm.priority >= 0, completion_tokens, now)
        # what one sequence generated: the lengths and timings it teaches are a sequence's
        completion_tokens //= adm.info.sequences
        if adm.tenant in self.tenants.by_name:  # (not a tenant a reload removed)
            lengths = self.tenants.output_models[adm.tenant]
            feedback.learn_output(lengths, self.policy, adm.info.model, completion_tokens)
            self.stats.count_slo(adm, now, completion_tokens)
        feedback.adapt_limits(self.policy, ms.tpot_target, replica, adm, now, completion_tokens)
        feedback.completed(adm, replica, now, completion_tokens)

    def requeue(self, request_id: str, now: float, retry_after: float | None = None) -> list[Event]:
        """The replica refused the dispatched request (its own queue cap, a 503 or 429; its
        `retry_after`, if it said one): take the permit back and hold the request again at the
        front of its queue instead of passing the refusal on. It still leaves at its original TTL.
        The replica rests (`placement.rest`); a request no replica will take ends now
        (`placement.nowhere_to_go`)."""
        taken = self._take_back(request_id, now)
        if taken is None:
            return []
        adm, ms = taken
        rest(self.replicas[adm.replica], self.policy, now, retry_after)  # type: ignore[index]
        refusal = nowhere_to_go(ms.replicas, adm, self.policy, now)
        if refusal is not None:
            return [self.finaliser.refuse(adm, refusal, now, Terminal.FAILED), *self.dispatcher.run(ms, now)]
        self.stats.note("requeued", Layer.UPSTREAM.value, Reason.UPSTREAM_REFUSED.value, adm.tenant, adm.priority)
        return self._hold_again(ms, adm, now)

    def unclaimed(self, request_id: str, others_blocks: int, now: float) -> list[Event]:
        """Its claim failed (`bouncer.core.sharing.claims`): the other gateways hold `others_blocks` on
        its replica, more than this gateway's view left room for. The permit goes back and the
        request waits at the head of its queue again, the replica counted as full as they hold
        it until the next sync brings their parts."""
        taken = self._take_back(request_id, now)
        if taken is None:
            return []
        adm, ms = taken
        claims.count_others(self.replicas[adm.replica], others_blocks, now)  # type: ignore[index]
        self.stats.note("requeued", Layer.FLOW.value, "claimed_elsewhere", adm.tenant, adm.priority)
        return self._hold_again(ms, adm, now)

    def _take_back(self, request_id: str, now: float) -> tuple[Admission, ModelState] | None:
        """A dispatched request's permit, released: it did not run where it was sent."""
        adm = self.permits.release(request_id, self.replicas)
        if adm is None:
            return None
        ms = self.models[adm.info.model]
        if adm.session is not None and isinstance(ms.agents, WindowGate):
            ms.agents.finished(adm, now)
        return adm, ms

    def _hold_again(self, ms: ModelState, adm: Admission, now: float) -> list[Event]:
        """A dispatched request, its permit released, back in its queue (where its order puts
        it: its first place, as it keeps its arrival and deadline). Its replica did not compute
        its prompt: the blocks recorded there for it are forgotten."""
        self.replicas[adm.replica].prefix.forget(adm.info.block_digests[adm.first_new_block:])  # type: ignore[index]
        adm.replica = adm.dispatched_at = adm.first_token_at = adm.decode_replica = adm.prefill_replica = None
        adm.blocks = adm.prefill_tokens = 0
        ms.flow.push(adm, self.tenants.weight(adm.tenant))
        return self.tick(now)

    def cancel(self, request_id: str, now: float) -> list[Event]:
        """The client went away while its request was queued: it leaves the queue at once."""
        for ms in self.models.values():
            adm = ms.flow.get(request_id)
            if adm is not None:
                self.finaliser.cancel_queued(adm, ms.flow, now)
                return self.dispatcher.run(ms, now)
        return []

    def renew(self, request_ids: Iterable[str], now: float) -> None:
        """The shell still serves these admitted requests: their permits live on."""
        self.permits.renew(request_ids, now + self.policy.permit_lease_s)

    # -- what the fleet says ---------------------------------------------------------------------
    def observe(self, replica: str, telemetry: Telemetry | None, now: float) -> list[Event]:
        """A scrape result; None when the scrape failed (the replica counts as unhealthy)."""
        r = self.replicas.get(replica)
        if r is None:
            return []
        if telemetry is None:
            r.healthy = False
        else:
            r.healthy = True
            previous, batch_then = r.telemetry, r.batch_at_sample
            r.observe(telemetry)
            if self.decodes_from_engines:
                feedback.engine_decodes(r, previous, batch_then, telemetry, now)
            r.check_drift(telemetry, now, self.policy.inflight_drift_s)
        ms = self.models[r.model]
        if ms.agents.enabled:
            ms.agents.observe(PoolView(ms.replicas, self.policy, now), now)
        return self.dispatcher.run(ms, now)

    def kv_events(self, replica: str, events: list[KVEvent], now: float) -> None:
        """KV-cache events an engine published (decoded from its wire format): they make the
        replica's prefix index precise while they flow."""
        r = self.replicas.get(replica)
        if r is not None:
            r.prefix.apply_events(events, now)

    def kv_digests(self, replica: str, stored: list[tuple[str, int]], removed: list[tuple[str, int]],
                   now: float) -> None:
        """The same, from an engine that names blocks by our own digests (the simulator's), as
        (medium, digest) pairs."""
        r = self.replicas.get(replica)
        if r is not None:
            r.prefix.apply_digests(stored, removed, now)

    # -- several gateways --------------------------------------------------------------------------
    def own_share(self, now: float) -> GatewayShare:
        """This gateway's part of what the gateways share (`bouncer.core.sharing.exchange`)."""
        return exchange.own_share(self.models, self.replicas, self.shares, self.stores.backlog, self.tenants.breakers,
                                 self.sent_prefixes, self.policy.fair_hold_s, now)

    def peers(self, others: list[GatewayShare], now: float) -> list[Event]:
        """The other gateways' parts, as last seen (`bouncer.core.sharing.exchange`); room they freed is used."""
        exchange.take_peers(self.models, self.replicas, self.shares, self.tenants.breakers, self.peer_prefixes, others,
                           now)
        return [e for ms in self.models.values() for e in self.dispatcher.run(ms, now)]

    # -- time --------------------------------------------------------------------------------------
    def tick(self, now: float) -> list[Event]:
        events: list[Event] = self._reclaim(now) if now >= self._next_lease_check else []
        for ms in self.models.values():
            expired = ms.flow.expired(now)
            empty = bool(expired) and ms.cfg.hold_without_replicas_s and not PoolView(ms.replicas, self.policy,
                                                                                       now).any_usable()
            for adm in expired:
                if ms.draining:  # held for a model swap that outlasted its TTL
                    reason, message = Reason.DRAINING, f"model `{adm.info.model}` is draining for a swap"
                elif empty:  # held for a replica that did not come up in time
                    reason, message = Reason.NO_BACKEND, f"no replica of model `{adm.info.model}` came up in time"
                else:
                    reason, message = Reason.TTL_EXPIRED, "queued longer than its TTL"
                events.append(leave(self.finaliser, ms, adm, Terminal.EXPIRED, reason, message, now))
            events.extend(self.dispatcher.run(ms, now))
        return events

    def _reclaim(self, now: float) -> list[Event]:
        """Take back the permits whose lease ran out: the shell lost track of them. Checked a
        few times per lease, so a lost permit is back within 1.25 leases."""
        self._next_lease_check = now + self.policy.permit_lease_s / 4
        events: list[Event] = []
        for adm in self.permits.expired(now):
            events.append(self.finaliser.reclaim(adm, now))
            ms = self.models[adm.info.model]
            if adm.session is not None and isinstance(ms.agents, WindowGate):
                ms.agents.finished(adm, now)
            events.extend(self.dispatcher.run(ms, now))
        return events

    def next_wakeup(self) -> float | None:
        """When `tick` must run next at the latest (`model_state.next_wakeup`)."""
        return next_wakeup(self.models, self.replicas)

    # -- operations --------------------------------------------------------------------------------
    def drain(self, model: str) -> None:
        if model not in self.models:
            raise ValueError(f"unknown model {model!r}")
        self.models[model].draining = True

    def undrain(self, model: str, now: float) -> list[Event]:
        self.drain(model)  # (checks the name)
        self.models[model].draining = False
        return self.dispatcher.run(self.models[model], now)

    def observe_pressure(self, name: str, value: float, at: float) -> None:
        """An outside signal's value, from `at` (the shell polls it); unknown names are ignored."""
        signal = self.pressures.get(name)
        if signal is not None:
            signal.observe(value, at)

    def record_refusal(self, request_id: str, refusal: Refusal, tenant: str = UNKNOWN_TENANT) -> Reject:
        """Count a refusal the shell made before the core could see the request (a body too
        large or not JSON), so every offered request is accounted in one place."""
        self.stats.arrive(tenant)
        return self.finaliser.refuse_unadmitted(request_id, tenant, None, refusal)

    def snapshot(self, now: float) -> dict:
        return self.view.snapshot(now)
