"""A new request, layer by layer: what the core's `precheck` and `offer` run.

The layers in order (the table in docs/concepts/architecture.md):
1. who it is and its model (`intake.checks`), then its parameters and its context budget;
2. its tenant's breaker and rate limits (`checks.TenantGate`);
3. its deadline: a retry past its first attempt's is refused or demoted (`deadlines`), and the
   rest get their queue budget;
4-5. the waiting room's doors (`waiting_room`), then the dispatch loop (`dispatch`) where the
   newcomer may go at once (not one queued behind its own tenant's head while the loop ran
   in the last `LOOP_FRESH_S`, where gateways do not share state);
and a request that has to wait is refused or demoted at once when the backlog ahead and the
prefill on its best replica already make it late (`late`, which the dispatch loop also calls for
a head that placement finds late).

The layers that need no prompt run first, on their own (`precheck`, `bouncer.core.precheck`), so
that the gateway refuses a flood before it tokenizes it. Reads the core's parts through the core,
since a reload rebuilds them; keeps only the arrival sequence numbers and the benchmarks'
exemption.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from bouncer.config import Tenant
from bouncer.core.finaliser import UNKNOWN_TENANT
from bouncer.core.fleet.cache_salt import SALTED_ENGINES, salted
from bouncer.core.fleet.pool import PoolView
from bouncer.core.flow import deadlines
from bouncer.core.flow.waiting_room import door, leave
from bouncer.core.intake import checks, quota
from bouncer.core.intake.pressure import pressure_refusal
from bouncer.core.intake.retries import first_arrival, first_seen
from bouncer.core.learning import feedback
from bouncer.core.model_state import ModelState
from bouncer.core.outcomes import Divert, Event, Layer, Reason, Refusal, Reject, Terminal
from bouncer.core.parts import CoreParts
from bouncer.core.precheck import cheap_refusal
from bouncer.core.requests import Admission, RequestInfo

# How stale the dispatch loop's last run may be for an arrival that cannot go (queued behind its
# tenant's head) not to run it again. Measured in `consolidation` at load 3: never running it
# there cost the realtime band (TTFT SLO 0.5 s) 0.5 points of attainment (97.61% against 98.09%);
# with this bound it kept 97.99%, and the m-mid pool at load 3 kept the whole saving.
LOOP_FRESH_S = 0.005


@dataclass(frozen=True, slots=True)
class Exemption:
    """A paired benchmark run's one request that is not refused as late (`bench feasibility`)."""

    request_id: str
    keep_queued: bool = False  # and it stays queued as long as its TTL allows, not its SLO's budget


class Arrivals:
    def __init__(self, core: CoreParts, exemption: Exemption | None = None) -> None:
        self.core = core
        self._seq = itertools.count()  # arrival order, for FCFS ties
        self._exemption = exemption

    def precheck(self, info: RequestInfo, now: float) -> tuple[Reject | Tenant, PoolView | None]:
        """`AdmissionCore.precheck`, and the pool view it judged by (None where it did not get
        that far), which `offer` may use on: nothing between them moves a replica."""
        c = self.core
        t = c.tenants.identify(info.key_digest, info.fairness_id)
        c.stats.arrive(UNKNOWN_TENANT if t is None else t.name)
        if t is None:
            return self._refuse_new(info, UNKNOWN_TENANT, None, Refusal(
                Layer.VALIDATION, Reason.UNAUTHENTICATED, "invalid or missing API key")), None
        asked = c.tenants.as_asked(t, info.objective)
        if asked is None:
            return self._refuse_new(info, t.name, t.priority, _unknown_objective(info.objective)), None
        t = c.tenants.demotions.applied(asked, now)  # past its quota, as last found: in the band it runs in
        ms = c.models.get(info.model)
        refusal = checks.validate_model(info.model, t, ms.cfg if ms else None) or pressure_refusal(
            c.pressures, t, now)
        if refusal is not None:
            return self._refuse_new(info, t.name, t.priority, refusal), None
        if not info.retry_count:  # demand, whatever the layers below decide (a retry is the same again)
            ms.demand.arrived_first(t.name, t.priority >= 0, now)  # type: ignore[union-attr]
        view = PoolView(ms.replicas, c.policy, now)  # type: ignore[union-attr]
        refusal = cheap_refusal(ms, t, info, c.gate, c.tenants.breakers[t.name], c.saturation, c.policy,
                                self._acts_on_late(info.request_id), view,
                                first_seen(c.finaliser.retries, t.name, info, now), now)
        if refusal is not None and not c.finaliser.overflow.may_take(info, t.name, refusal.reason):
            # as offer remembers what the gate or the door refuses
            first_arrival(c.finaliser.retries, t.name, info, now)
            return c.finaliser.refuse_unadmitted(info.request_id, t.name, t.priority, refusal, info.model,
                                                 now), None
        # (a refusal an overflow target may take instead is left to `offer`: it tokenizes first)
        return t, view

    def offer(self, info: RequestInfo, now: float, checked: Tenant | None = None) -> list[Event]:
        """`AdmissionCore.offer`: `checked` is its tenant as `precheck` found it, where the shell
        ran that first (else it runs here)."""
        c = self.core
        view: PoolView | None = None
        if checked is None:
            found, view = self.precheck(info, now)
            if isinstance(found, Reject):
                return [found]
            checked = found
        t = c.tenants.get(checked.name)  # (a reload may have come since the precheck)
        if t is None:
            return [self._refuse_new(info, UNKNOWN_TENANT, None, Refusal(
                Layer.VALIDATION, Reason.UNAUTHENTICATED, "invalid or missing API key"))]
        asked = c.tenants.as_asked(t, info.objective)
        if asked is None:
            return [self._refuse_new(info, t.name, t.priority, _unknown_objective(info.objective))]
        t = asked
        ms = c.models.get(info.model)
        refusal = checks.validate(info, t, ms.cfg if ms else None, c.config.limits)  # layer 1
        if refusal is not None or ms is None:
            return [self._refuse_new(info, t.name, t.priority, refusal)]
        max_tokens = checks.context_budget(info, t, ms.cfg)  # layer 2
        if isinstance(max_tokens, Refusal):
            return [self._refuse_new(info, t.name, t.priority, max_tokens)]
        c.tenants.demotions.note(t.name, info.over_quota, now)
        if info.over_quota is not None:  # the shell found its quota spent (`intake.quota`)
            spent = self._over_quota(info, t, max_tokens, now)
            if not isinstance(spent, Tenant):
                return [spent]
            t = spent
        retry_key, first_arrival_at = first_arrival(c.finaliser.retries, t.name, info, now)
        salt = c.tenants.cache_salts.get(t.name) if ms.cfg.engine in SALTED_ENGINES else None
        if salt is not None and info.cache_salt is None:  # its prefix is its cache group's, as the engine keys it
            info.block_digests = salted(info.block_digests, c.tenants.salt_roots[t.name])
            info.cache_salt = salt
        charge = checks.token_charge(info, max_tokens)
        refusal, probe = c.gate.enter(t, c.tenants.breakers[t.name], charge, now)  # rate
        if refusal is not None:
            return [self._refuse_new(info, t.name, t.priority, refusal)]
        lengths = c.tenants.output_models[t.name]
        expected = feedback.expected_output(lengths, c.policy, info.model, max_tokens) * info.sequences
        adm, ttft_left = deadlines.new_admission(info, t, c.policy, max_tokens, expected, first_arrival_at, retry_key,
                                                 next(self._seq), now)
        adm.breaker_probe, adm.rate_charge, adm.context_limit = probe, charge, ms.cfg.max_model_len
        if ms.cfg.disaggregated:
            adm.mean_output = feedback.mean_output(lengths, c.policy, info.model, max_tokens)
        if not info.retry_count:
            ms.demand.sized(t.name, t.priority >= 0, info.prompt_tokens, now)
        ms.band_slos.note(adm.priority, t.slo, now)
        if ttft_left is not None and ttft_left <= 0:  # a retry past its first attempt's deadline
            refusal = deadlines.past_first_deadline(adm, t, c.policy, self.acts_on_late(adm),
                                                    now - first_arrival_at)  # type: ignore[operator]
            if refusal is not None:
                return [c.finaliser.refuse(adm, refusal, now)]
            c.stats.note("demoted", Layer.SLO.value, Reason.RETRY_PAST_DEADLINE.value, adm.tenant, adm.priority)
            ttft_left = None
        if view is None or view.replicas is not ms.replicas:
            view = PoolView(ms.replicas, c.policy, now)
        if not view.any_usable() and ms.cfg.hold_without_replicas_s and not ms.draining:
            deadlines.hold_for_a_replica(adm, ms.cfg.hold_without_replicas_s, now)
            ttft_left = None
        best_ttft = c.placement.best_ttft(ms.replicas, adm, view) if ttft_left else None
        if ttft_left and not self.exempt(adm, keeping_queued=True):
            deadlines.queue_budget(adm, ttft_left, best_ttft, ms, c.policy, now)
        ms.agents.classify(adm)
        return self._enter_waiting_room(ms, adm, view, ttft_left, best_ttft, now)  # layers 4 and 5

    def _refuse_new(self, info: RequestInfo, tenant: str, band: int | None, refusal: Refusal) -> Reject:
        return self.core.finaliser.refuse_unadmitted(info.request_id, tenant, band, refusal)

    def _over_quota(self, info: RequestInfo, t: Tenant, max_tokens: int, now: float) -> Tenant | Reject | Divert:
        """Its tenant's quota is spent: the tenant as demoted, or the refusal, or the divert."""
        c, over = self.core, info.over_quota
        assert over is not None
        if over.action == "demote":
            c.stats.note("demoted", Layer.RATE.value, Reason.QUOTA_EXHAUSTED.value, t.name, over.band)
            return quota.demoted(t, over)
        ttl = min(t.queue_ttl_s or c.policy.default_ttl_s, info.ttl_s or float("inf"))
        refusal = quota.refusal(over, ttl)
        if over.action == "divert":
            return c.finaliser.divert_unadmitted(info, t.name, t.priority, refusal, max_tokens, now)
        return self._refuse_new(info, t.name, t.priority, refusal)

    def _enter_waiting_room(self, ms: ModelState, adm: Admission, view: PoolView, ttft_left: float | None,
                            best_ttft: float | None, now: float) -> list[Event]:
        c = self.core
        entry = door(ms, adm, view, c.saturation, c.policy, now)
        if isinstance(entry, Refusal):
            return [c.finaliser.refuse(adm, entry, now)]
        events: list[Event] = [leave(c.finaliser, ms, victim, Terminal.EVICTED, Reason.EVICTED,
                                     "evicted from the queue by traffic that goes before it", now) for victim in entry]
        # Queued, it has to wait. If the backlog ahead and the prefill work on the best replica
        # already add up to more than its TTFT SLO, say so now (before any prefill), and when to
        # come back: once enough of it has drained.
        left = ttft_left if ttft_left and not ms.draining and adm.ttft_deadline is not None else None
        judged = False
        if left is not None and not entry and self._waits_behind_its_head(ms, adm, now) and self.acts_on_late(adm):
            # nothing moves between its queueing and its judgement (the loop does not run for
            # it): judged first, a late one is refused without being queued and taken out again
            # (under overload most arrivals are: ServeGen m-mid at load 3, 186k of 215k)
            late = deadlines.late_by(ms, adm, left, best_ttft, c.policy, now, queued=False)
            if late is not None:
                return events + self.late(adm, now, late)
            judged = True
        ms.flow.push(adm, c.tenants.weight(adm.tenant))
        if not judged and self._loop_due(ms, adm, bool(entry), now):
            events.extend(c.dispatcher.run(ms, now, view))
        if left is not None and not judged and adm.request_id in ms.flow:
            late = deadlines.late_by(ms, adm, left, best_ttft, c.policy, now)
            if late is not None:
                events.extend(self.late(adm, now, late))
        return events

    def _waits_behind_its_head(self, ms: ModelState, adm: Admission, now: float) -> bool:
        """Whether `adm`, not queued yet, would wait behind its tenant's head with the loop not
        due (`_loop_due` of it once queued, with no request evicted, False)."""
        if self._loop_runs_anyway(ms, adm, now):
            return False
        q = ms.flow.tenant_queue(adm)
        return q is not None and q.count > 0 and not q.would_lead(adm)

    def _loop_runs_anyway(self, ms: ModelState, adm: Admission, now: float) -> bool:
        """Whether the loop runs for `adm` whatever its place in its tenant's queue (`_loop_due`)."""
        return adm.session is not None or self.core.shares.enabled or now - ms.looped_at >= LOOP_FRESH_S

    def _loop_due(self, ms: ModelState, adm: Admission, evicted: bool, now: float) -> bool:
        """Whether the dispatch loop runs for `adm`, just queued: where it may go now (at the head
        of its tenant's queue; an agent's step, which may go past its tenant's head,
        `Dispatcher.next_agent_step`; or having evicted requests, whose queues have new heads).
        Any other waits behind its own tenant's head and moves nothing the loop reads, so the loop
        runs for it only where its last run is older than LOOP_FRESH_S (what the clock alone
        changes, a head turning late, a hold running out, is then acted on that much later at
        most). Under overload nearly every arrival is one of those, and a loop run for each was
        the largest part of an arrival's cost (ServeGen m-mid at load 3: 90k runs in 30 s, 808
        placing anything). Always where gateways share state: there the loop also follows the
        others' service and queues, and skipping it cost three sharing gateways 10% of goodput
        (`surge` at load 2, 92.65 against 102.38 req/s; tests/test_sim_gateways.py)."""
        return (evicted or self._loop_runs_anyway(ms, adm, now)
                or ms.flow.tenant_queue(adm).head() is adm)  # type: ignore[union-attr]

    # -- lateness: at arrival, and for a head the dispatch loop finds late ------------------------
    def acts_on_late(self, adm: Admission) -> bool:
        """Whether a request predicted to miss its deadline is refused or demoted (else only
        flagged)."""
        return self._acts_on_late(adm.request_id)

    def _acts_on_late(self, request_id: str) -> bool:
        """`acts_on_late` by id, for the precheck (no Admission yet): all but the exempt one."""
        e = self._exemption
        return self.core.policy.refuse_infeasible and (e is None or e.request_id != request_id)

    def exempt(self, adm: Admission, keeping_queued: bool = False) -> bool:
        e = self._exemption
        return e is not None and e.request_id == adm.request_id and (e.keep_queued or not keeping_queued)

    def late(self, adm: Admission, now: float, late_by: float) -> list[Event]:
        """`adm` (queued) is predicted to miss its TTFT deadline (`deadlines.act_on_late`)."""
        adm.predicted_infeasible = True
        if not self.acts_on_late(adm):
            return []
        c = self.core
        return deadlines.act_on_late(adm, c.tenants.get(adm.tenant), c.models[adm.info.model], c.policy, c.stats,
                                     c.finaliser, late_by, now)


def _unknown_objective(name: str | None) -> Refusal:
    return Refusal(Layer.VALIDATION, Reason.INVALID_PARAMETER, f"unknown inference objective {name!r}",
                   param="x-llm-d-inference-objective")
