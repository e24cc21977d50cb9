"""The waiting room's doors, at arrival: whether a request may join the queue at all.

Layers 4 and 5 as a request arrives, in order: a model being drained holds only so many; with no
usable backend nothing is queued (unless the model holds requests for a replica to come up,
`hold_without_replicas_s`); sheddable traffic is refused while the pool is saturated past
its band's ceiling; a tenant's own queue is bounded (429: its fault), and so is the whole room,
per band and in total (529: the fleet's), where a newcomer that outranks the lowest queued
sheddable request evicts it instead of being refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bouncer.config import Policy
from bouncer.core.fleet.pool import PoolView
from bouncer.core.flow.saturation import SaturationDetector, ceiling
from bouncer.core.model_state import ModelState
from bouncer.core.outcomes import Divert, Layer, Reason, Refusal, Reject, Terminal
from bouncer.core.requests import Admission

if TYPE_CHECKING:
    from bouncer.core.finaliser import Finaliser


def door_shut(ms: ModelState, tenant: str, band: int, view: PoolView, saturation: SaturationDetector,
              policy: Policy, now: float, min_prompt: int = 0, own_queue: bool = True) -> Refusal | None:
    """Why no request of `tenant` in `band` may join the waiting room now, whatever its size
    (of at least `min_prompt` tokens): the checks that need no prompt, so that a request they
    refuse is refused before its prompt is tokenized (`AdmissionCore.precheck`). `own_queue`:
    its tenant's queue being full counts (not for an agent's step, which may displace a new
    agent's request from it: `door`)."""
    # (no closure for the refusals: this runs at every arrival, and they are rare)
    flow = ms.flow
    if ms.draining:
        if len(flow) >= policy.drain_queue_cap:
            return _refused(ms, band, tenant, now, Layer.FLOW, Reason.DRAINING,
                            f"model `{ms.cfg.name}` is draining for a swap")
    else:
        usable = view.any_usable()
        if not usable and not ms.cfg.hold_without_replicas_s:
            return _refused(ms, band, tenant, now, Layer.QUEUE, Reason.NO_BACKEND,
                            f"no usable backend for model `{ms.cfg.name}`")
        # with none usable and a hold, every band waits for a replica (a batch job sent to a pool
        # scaled to zero is held too); once one answers, its ceiling applies at dispatch
        if band < 0 and usable and saturation.saturation(view) >= ceiling(policy, band):
            return _refused(ms, band, tenant, now, Layer.FLOW, Reason.SATURATED,
                            "the fleet is saturated; sheddable traffic is refused")
    q = flow.queue_of(tenant, band)
    if own_queue and q is not None and (q.count >= policy.queues.tenant_max_requests
                                        or (min_prompt and q.tokens + min_prompt > policy.queues.tenant_max_tokens)):
        return _tenant_queue_full(ms, band, tenant, now)
    band_state = flow.bands.get(band)
    if band_state is not None and band_state.count >= policy.queues.band_max_requests:
        # (evicting from the bands below would not make room in this one)
        return _refused(ms, band, tenant, now, Layer.QUEUE, Reason.QUEUE_FULL, "the waiting room is full")
    return None


def _refused(ms: ModelState, band: int, tenant: str, now: float, layer: Layer, reason: Reason,
             message: str) -> Refusal:
    """A door's refusal, with when to come back (`Backlog.retry_after`)."""
    return Refusal(layer, reason, message, ms.backlog.retry_after(band, now, tenant,
                                                                  behind_backlog=reason is Reason.SATURATED))


def _tenant_queue_full(ms: ModelState, band: int, tenant: str, now: float) -> Refusal:
    return _refused(ms, band, tenant, now, Layer.QUEUE, Reason.TENANT_QUEUE_FULL,
                    f"tenant {tenant!r} has too many queued requests")


def door(ms: ModelState, adm: Admission, view: PoolView, saturation: SaturationDetector,
         policy: Policy, now: float) -> Refusal | list[Admission]:
    """Why `adm` may not join the waiting room, or the queued requests it evicts (often none).
    Its tenant's queue full, a request of a higher rank there (an active agent's step over a new
    agent's: `Admission.queue_rank`) displaces the newest of the lowest rank: refusing the step
    would fail a session midway, and all the steps done for it; the new agent has none done
    yet. (In the `agents` scenario at 512 agents on 2 replicas, new agents waiting their turn
    filled the queue, and all 453 sessions that failed midway failed so.)"""
    flow, band = ms.flow, adm.priority
    shut = door_shut(ms, adm.tenant, band, view, saturation, policy, now, own_queue=False)
    if shut is not None:
        return shut

    q = flow.tenant_queue(adm)
    qc = policy.queues
    prompt = adm.info.prompt_tokens
    victims: list[Admission] = []
    if q is not None and (q.count >= qc.tenant_max_requests or q.tokens + prompt > qc.tenant_max_tokens):
        n, queued = q.count, q.tokens
        for last in q.last_in_line(adm.queue_rank):
            victims.append(last)
            n, queued = n - 1, queued - last.info.prompt_tokens
            if n < qc.tenant_max_requests and queued + prompt <= qc.tenant_max_tokens:
                break
        else:
            return _tenant_queue_full(ms, band, adm.tenant, now)
    count, tokens = len(flow) - len(victims), flow.tokens - sum(v.info.prompt_tokens for v in victims)
    while count >= qc.max_requests or tokens + prompt > qc.max_tokens:
        victim = flow.lowest_sheddable(below=band, excluding=victims)
        if victim is None:
            return _refused(ms, band, adm.tenant, now, Layer.QUEUE, Reason.QUEUE_FULL, "the waiting room is full")
        victims.append(victim)
        count, tokens = count - 1, tokens - victim.info.prompt_tokens
    return victims


def leave(finaliser: Finaliser, ms: ModelState, adm: Admission, terminal: Terminal, reason: Reason, message: str,
          now: float) -> Reject | Divert:
    """A queued request leaves the waiting room with an error (evicted, expired, drained), or for
    an overflow target; its Retry-After counts the room without it."""
    return finaliser.refuse(adm, lambda: Refusal(Layer.FLOW, reason, message, ms.backlog.retry_after(
        adm.priority, now, adm.tenant)), now, terminal, ms.flow)
