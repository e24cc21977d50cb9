"""The layers a new request meets before its prompt is tokenized: those that need no prompt.

`AdmissionCore.precheck` runs them first (the gateway calls it before it tokenizes the prompt
and hashes its blocks), so that a flood they refuse costs no tokenizing: an open breaker or a
rate limit with nothing left (looked at, not taken: `offer` charges the real token count), a
shut waiting-room door (draining, no backend, sheddable while saturated, a full tenant or band
queue), a client's retry past its first attempt's deadline, and a queue ahead that alone
outlasts the request's TTFT SLO (the gateway's queue, and the prefill queued on the best replica,
with none of its own). Each refuses as the layer `offer` runs later would; a request these pass
may still be refused there, with its tokens.

Under overload most arrivals are clients' retries (ServeGen m-mid at load 3: 2.5 attempts a
request). Those already past their first attempt's deadline were tokenized, charged and refused
in `offer` before this looked at their first attempt (36,602 of 236,742 attempts there).
"""

from __future__ import annotations

from bouncer.config import Policy, Tenant
from bouncer.core.fleet.pool import PoolView
from bouncer.core.flow import deadlines
from bouncer.core.flow.saturation import SaturationDetector
from bouncer.core.flow.waiting_room import door_shut
from bouncer.core.intake.breaker import CircuitBreaker
from bouncer.core.intake.checks import TenantGate
from bouncer.core.model_state import ModelState
from bouncer.core.outcomes import Layer, Reason, Refusal
from bouncer.core.requests import RequestInfo


def cheap_refusal(ms: ModelState, tenant: Tenant, info: RequestInfo, gate: TenantGate, breaker: CircuitBreaker,
                  saturation: SaturationDetector, policy: Policy, refuses_late: bool, view: PoolView,
                  first_at: float | None, now: float) -> Refusal | None:
    """Why `info` is refused whatever its prompt, or None. `refuses_late`: requests predicted
    to miss their deadline are refused (not only flagged); `view`: `ms`'s pool at `now`;
    `first_at`: when its first attempt came, for a retry whose first attempt is remembered."""
    # (an agent's step may displace a new agent's request from its tenant's full queue: `offer` judges it)
    agent = ms.agents.names_a_session(info)
    shut = gate.closed(tenant, breaker, now) or door_shut(ms, tenant.name, tenant.priority, view, saturation,
                                                          policy, now, info.min_prompt_tokens, own_queue=not agent)
    if shut is not None:
        return shut
    slo = deadlines.tighter(info.ttft_slo_s, tenant.slo.ttft_s)
    if not slo or tenant.slo.on_infeasible != "refuse" or not refuses_late:
        return None
    if first_at is not None and now - first_at >= slo:
        return deadlines.retry_past_deadline(slo, now - first_at)
    # A retry not yet past its first deadline is judged late here on its whole SLO, as a first
    # attempt is. Judged on what that deadline leaves, the precheck refused retries `offer` sends
    # (the earlier deadline puts one at its tenant's head, where the dispatch loop may send it:
    # 186 in fairness at load 2, -1.2% goodput), and skipped the loop runs `offer` makes for the
    # rest, which keep held requests moving (consolidation's realtime band at load 3: 97.84% of
    # its SLO against 98.24%). `offer` judges it on what is left.
    return _surely_late(ms, tenant, info, view, policy, slo, now)


def _surely_late(ms: ModelState, tenant: Tenant, info: RequestInfo, view: PoolView, policy: Policy, slo: float,
                 now: float) -> Refusal | None:
    """Refused as the core refuses a late newcomer once tokenized: the least TTFT it could have
    on any replica (the prefill queued there, with none of its own), after the gateway's queue
    ahead when it waits behind its own tenant's queued requests, outlasts its TTFT SLO. Not an
    agent's step (it goes ahead of its tenant's queue), nor while draining."""
    if info.session_id is not None or ms.draining:
        return None
    own = ms.flow.queue_of(tenant.name, tenant.priority)
    # with nothing of its own queued it is its tenant's next turn, which fair queueing gives it
    # sooner than the whole band's backlog that the estimate counts: the queue is not counted
    behind_own = own is not None and own.count > 0
    predicts = any(r.predictor is not None for r in view.usable_replicas())
    floors = [f for r in view.prompt_workers() if (f := r.ttft_floor()) is not None]
    # `offer` refuses a queued request whose wait plus margin x best TTFT outlasts its SLO, and
    # one it could send now if no replica with room predicts it in time (no margin): the floor
    # counts the smaller factor, so that what this refuses, both would
    margin = min(1.0, ms.ttft_margins.margin(tenant.priority) or policy.ttft_safety_factor)
    floor = min(floors) * margin if floors else None
    if not behind_own and floor is None:
        return None
    late = deadlines.surely_late(ms, tenant.priority, tenant.name, slo, predicts, floor, behind_own,
                                 policy, now)
    if late is None:
        return None
    standing = behind_own and ms.standing.standing(tenant.priority, tenant.name, now)
    return Refusal(Layer.SLO, Reason.DEADLINE_INFEASIBLE, deadlines.late_message(late, slo, standing, policy),
                   ms.backlog.retry_after(tenant.priority, now, tenant.name, late))
