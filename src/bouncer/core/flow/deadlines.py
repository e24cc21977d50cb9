"""Deadlines: a request's SLOs and TTL, how long it may wait, and whether it can still be on time.

- SLOs are its tenant's; a client's headers may only tighten them (`tighter`). A retry keeps its
  first attempt's TTFT deadline (`policy.retries`): its user has waited since then.
- Its queue TTL is its tenant's (or a client's shorter one), and with `ttl_within_slo` it leaves
  the waiting room once waiting longer could only make it late: its TTFT SLO minus the best
  predicted TTFT times its band's margin (`queue_budget`; `bouncer.core.learning.ttft_margin`: the
  band's measured prediction error, or `ttft_safety_factor` until it is measured).
- Feasibility: queued at arrival, a request whose wait plus predicted TTFT already runs past its
  SLO is late (`late_by`), and is refused (429 deadline_infeasible) or demoted to best-effort
  (`demote`), as its tenant says, before any prefill.
- Where its tenant's queue stands (sustained overload: `bouncer.core.flow.standing_queue`), both plan
  on `standing_queue_share` of what its SLO leaves (`planned_left`): that queue serves as many
  requests, and none at the SLO's edge.
- Band protection: `band_slos`.
"""

from __future__ import annotations

from bouncer.config import Policy, Tenant
from bouncer.core.finaliser import CoreStats, Finaliser
from bouncer.core.model_state import ModelState
from bouncer.core.outcomes import Event, Layer, Reason, Refusal, Terminal
from bouncer.core.requests import Admission, RequestInfo, RetryKey

INF = float("inf")


def tighter(asked: float | None, configured: float | None) -> float | None:
    """The stricter of a client's SLO and its tenant's (either may be unset)."""
    if asked is None or configured is None:
        return configured if asked is None else asked
    return min(asked, configured)


def new_admission(info: RequestInfo, tenant: Tenant, policy: Policy, max_tokens: int, expected_output: int,
                  first_arrival: float | None, retry_key: RetryKey | None, seq: int,
                  now: float) -> tuple[Admission, float | None]:
    """The request as the later layers see it, with its deadlines; and how much of its TTFT SLO
    is left (less than the SLO for a retry; None without one)."""
    ttl = tenant.queue_ttl_s or policy.default_ttl_s
    if info.ttl_s is not None:
        ttl = min(ttl, info.ttl_s)
    ttft_slo = tighter(info.ttft_slo_s, tenant.slo.ttft_s)
    ttft_left = ttft_slo - (now - first_arrival) if ttft_slo and first_arrival is not None else ttft_slo
    adm = Admission(info=info, tenant=tenant.name, priority=tenant.priority, max_tokens=max_tokens,
                    expected_output=expected_output, arrival=now, deadline=now + ttl,
                    ttft_deadline=now + ttft_left if ttft_slo else None, ttft_slo=ttft_slo,
                    tpot_slo=tighter(info.tpot_slo_s, tenant.slo.tpot_s), seq=seq, retry_key=retry_key,
                    lease_until=now + policy.permit_lease_s)
    return adm, ttft_left


def hold_for_a_replica(adm: Admission, hold_s: float, now: float) -> None:
    """The model has no replica that answers (scaled to zero, or every one starting) and holds
    requests for one to come up (`hold_without_replicas_s`): `adm` waits up to that, or its
    client's shorter TTL. Its TTFT SLO is not planned on (no replica can start it in time, and
    refusing it as infeasible would only send it back to wait again); it stays its band's."""
    hold = hold_s if adm.info.ttl_s is None else min(hold_s, adm.info.ttl_s)
    adm.deadline = now + hold
    adm.ttft_deadline = None


def planned_left(ms: ModelState, priority: int, tenant: str, ttft_left: float, policy: Policy, now: float) -> float:
    """What a queued request of `tenant` in band `priority` is planned on of the `ttft_left` its
    SLO leaves: all of it, or `standing_queue_share` of it while that tenant's queue stands."""
    if ms.standing.standing(priority, tenant, now):
        return ttft_left * policy.standing_queue_share
    return ttft_left


def queue_budget(adm: Admission, ttft_left: float, best_ttft: float | None, ms: ModelState, policy: Policy,
                 now: float) -> None:
    """Waiting longer, it could only be served late: its queueing budget is what its SLO leaves
    (as planned: `planned_left`) after the best predicted TTFT, with room for that prediction's
    error (its band's margin; not measured yet, ttft_safety_factor; without a step-time model, a
    fixed share of the SLO)."""
    if not policy.ttl_within_slo:
        return
    left = planned_left(ms, adm.priority, adm.tenant, ttft_left, policy, now)
    margin = ms.ttft_margins.margin(adm.priority) or policy.ttft_safety_factor
    budget = left - margin * best_ttft if best_ttft is not None else left * policy.slo_queue_fraction
    adm.deadline = min(adm.deadline, now + max(0.0, budget))


def late_by(ms: ModelState, adm: Admission, ttft_left: float, best_ttft: float | None, policy: Policy,
            now: float, queued: bool = True) -> float | None:
    """How far past its TTFT deadline (`ttft_left` from now, as planned: `planned_left`) a
    queued newcomer is predicted to start (None: in time, or no estimate): the wait in the
    gateway's queue, then the best predicted TTFT, from the prefill work on the replica, x its
    band's margin (or ttft_safety_factor, as in queue_budget). Without a step-time model: the
    wait (to its first token) against slo_queue_fraction of what is left. `queued=False`: it is
    judged as if queued behind its tenant's queued requests, before it is."""
    left = planned_left(ms, adm.priority, adm.tenant, ttft_left, policy, now)
    unqueued = 0 if queued else 1
    if best_ttft is None:
        wait = ms.backlog.estimated_wait(adm.priority, now, adm.tenant, unqueued)
        budget = left * policy.slo_queue_fraction
        return wait - budget if wait is not None and wait > budget else None
    wait = ms.backlog.queue_wait(adm.priority, now, adm.tenant, unqueued) or 0.0
    late = wait + (ms.ttft_margins.margin(adm.priority) or policy.ttft_safety_factor) * best_ttft - left
    return late if late > 0 else None


def surely_late(ms: ModelState, priority: int, tenant: str, ttft_left: float, predicts: bool,
                ttft_floor: float | None, behind_queue: bool, policy: Policy, now: float) -> float | None:
    """What `late_by` would at least say of a newcomer whose prompt is not known yet: late
    already by `ttft_floor` (the least its TTFT can be: the prefill queued on the best replica,
    with none of its own; 0 if not known), after the wait in the gateway's queue where it waits
    `behind_queue` (and is planned as `late_by` plans it). For the precheck."""
    if behind_queue:
        ttft_left = planned_left(ms, priority, tenant, ttft_left, policy, now)
    if not predicts:
        if not behind_queue:
            return None
        wait = ms.backlog.estimated_wait(priority, now, tenant)
        budget = ttft_left * policy.slo_queue_fraction
        return wait - budget if wait is not None and wait > budget else None
    wait = (ms.backlog.queue_wait(priority, now, tenant) or 0.0) if behind_queue else 0.0
    late = wait + (ttft_floor or 0.0) - ttft_left
    return late if late > 0 else None


def late_message(late: float, slo: float | None, standing: bool, policy: Policy) -> str:
    if standing:
        return (f"predicted to start ~{late:.2f} s past {policy.standing_queue_share:.0%} of what this request's "
                f"TTFT SLO ({slo:g} s) leaves, what its tenant's requests are planned on while their queue "
                f"stands (sustained overload)")
    return f"predicted to start ~{late:.2f} s past this request's TTFT SLO ({slo:g} s)"


def past_first_deadline(adm: Admission, tenant: Tenant, policy: Policy, acting: bool,
                        since_first: float) -> Refusal | None:
    """A retry whose first attempt's deadline has passed: as its tenant says of infeasible
    requests, refused (another retry cannot meet it either), or demoted to best-effort (None).
    `acting`: refusals of late requests are on (else it is only flagged, and demoted)."""
    adm.predicted_infeasible = True
    if tenant.slo.on_infeasible == "refuse" and acting:
        return retry_past_deadline(adm.ttft_slo, since_first)  # type: ignore[arg-type]
    demote(adm, tenant, policy)
    return None


def retry_past_deadline(slo: float, since_first: float) -> Refusal:
    return Refusal(Layer.SLO, Reason.RETRY_PAST_DEADLINE, f"a retry {since_first:.2f} s after its first attempt, "
                   f"past that attempt's TTFT SLO ({slo:g} s): another retry cannot meet it")


def demote(adm: Admission, tenant: Tenant, policy: Policy) -> None:
    """`adm` (not queued) will run best-effort: in the best-effort band, without a TTFT
    deadline, until its TTL."""
    adm.best_effort = True
    adm.priority = min(adm.priority, policy.best_effort_priority)
    adm.ttft_deadline = None  # EDF now orders it by its TTL, no longer cut to the SLO
    ttl = tenant.queue_ttl_s or policy.default_ttl_s
    adm.deadline = adm.arrival + min(ttl, adm.info.ttl_s if adm.info.ttl_s is not None else ttl)


def act_on_late(adm: Admission, tenant: Tenant | None, ms: ModelState, policy: Policy, stats: CoreStats,
                finaliser: Finaliser, late_by: float, now: float) -> list[Event]:
    """A queued request predicted to miss its TTFT deadline by `late_by`, where late requests are
    acted on: served best-effort, lower down, or refused, as its tenant says."""
    if tenant is not None and tenant.slo.on_infeasible == "best-effort":  # it stays, lower down
        ms.flow.remove(adm)
        demote(adm, tenant, policy)
        ms.flow.push(adm, tenant.weight)
        stats.note("demoted", Layer.SLO.value, Reason.DEADLINE_INFEASIBLE.value, adm.tenant, adm.priority)
        return []
    # queued since an earlier call: it leaves the waiting room as an expiry, not a refusal
    terminal = Terminal.REFUSED if adm.arrival == now else Terminal.EXPIRED
    # when new work like it would fit: once what waits ahead of it now has been served (its
    # lateness alone says too little: arrivals go on, and with them the backlog; measured,
    # `retry_after_accuracy` in `bench run`)
    standing = ms.standing.standing(adm.priority, adm.tenant, now)
    return [finaliser.refuse(adm, lambda: Refusal(
        Layer.SLO, Reason.DEADLINE_INFEASIBLE, late_message(late_by, adm.ttft_slo, standing, policy),
        ms.backlog.retry_after(adm.priority, now, adm.tenant, late_by)),
        now, terminal, ms.flow)]
