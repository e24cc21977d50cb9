"""A request's journey around the core's decisions, written once for every driver.

The core decides (`Dispatch`, `Divert`, `Reject`). What follows each decision is the same
wherever the core runs, so it lives here, sans-IO, and both drivers run it: the gateway's
control plane (`bouncer.gateway.control_plane`) and the simulator's policy
(`bouncer.sim.policies.CorePolicy`). A benchmark then measures what production runs.

- a divert to another model's pool is offered there again (never diverted twice); a divert to an
  external endpoint is relayed by a driver that can (`Relay`) and refused by one that cannot;
- a dispatch to a nearly full replica is claimed first among several gateways (`Claim`): the
  driver asks the shared state and hands back what the others hold (`claimed`); filled first,
  the request is held again;
- the quota reserved for a request is settled once, on how it ended (`settlement`);
- the permits of what is being served are renewed (`renew`).

The drivers do the waiting (a claim or a quota reservation in Redis, a client's answer) and say
what happened (`started`, `finished`, `cancel`, `requeue`); steps come back as values.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple, Protocol

from bouncer.core.outcomes import Dispatch, Divert, Event, Reason, Reclaimed, Reject, Terminal
from bouncer.core.requests import RequestInfo
from bouncer.core.usage import estimated_usage

if TYPE_CHECKING:
    from bouncer.core.admission import AdmissionCore
    from bouncer.core.arrivals import Tenant
    from bouncer.quotas.settings import OverflowTarget


@dataclass(slots=True)
class Outcome:
    """How an admitted request ended, as its driver saw it. `completion_tokens` None: the answer's
    length was not seen (an endpoint picker that let it pass, a client that left before a whole
    answer came). `prompt_tokens`: the engine's own count, where its usage said (the gateway's
    count stands in otherwise)."""

    terminal: Terminal = Terminal.FAILED
    reason: Reason | None = Reason.UPSTREAM_ERROR
    completion_tokens: int | None = 0
    first_token_at: float | None = None
    prompt_tokens: int | None = None


class Via(NamedTuple):
    """The overflow pool a request was diverted to, and why."""

    target: str
    reason: str


class Go(NamedTuple):
    """Serve it: its permit is the driver's until `finished`."""

    dispatch: Dispatch
    via: Via | None = None


class Claim(NamedTuple):
    """Claim its nearly full replica among the gateways first, then hand the answer to `claimed`."""

    dispatch: Dispatch
    via: Via | None = None


class Relay(NamedTuple):
    """Send it to an external overflow endpoint; `relayed` when it is over."""

    divert: Divert
    target: OverflowTarget


class Refuse(NamedTuple):
    """Its client gets this refusal (its quota's reservation is given back)."""

    reject: Reject
    via: Via | None = None


Step = Go | Claim | Relay | Refuse | Reclaimed


class QuotaSettler(Protocol):
    def settle(self, rid: str, prompt_tokens: int, completion_tokens: int | None,
               overflow_target: str | None = None) -> None: ...


class _Trip:
    """What the journey keeps of a request between its offer and its end."""

    __slots__ = ("info", "via", "dispatch", "first_token_at", "relayed_to")

    def __init__(self, info: RequestInfo) -> None:
        self.info = info
        self.via: Via | None = None
        self.dispatch: Dispatch | None = None
        self.first_token_at: float | None = None
        self.relayed_to: str | None = None


def settlement(out: Outcome, counted_prompt: int, dispatch: Dispatch | None, now: float) -> tuple[int, int | None]:
    """(prompt, completion) tokens a request is charged for: the engine's usage where it said (a
    stream's usage in every chunk says it before its first token); the tokens streamed where a
    stream was cut before its usage came; for a request dispatched to the pool whose client left
    before the engine said anything, what the core's predictions say was done by then
    (`bouncer.core.usage`); an answer not seen (behind an endpoint picker) is charged what it
    reserved (completion None); nothing for a request that never ran, or that its replica failed
    before its answer began."""
    engine_said = out.prompt_tokens is not None  # only the engine's usage sets it
    prompt = out.prompt_tokens if engine_said else counted_prompt
    if out.terminal is Terminal.COMPLETED or out.first_token_at is not None or engine_said:
        return prompt, out.completion_tokens
    if out.terminal is Terminal.CANCELLED and dispatch is not None:  # it ran, and its client left unanswered
        return estimated_usage(dispatch, prompt, now)
    return 0, 0


class Journey:
    """The steps around one core's decisions for each request it is offered.

    `quotas`: where spend is kept, settled as each request ends (None: no quotas); `relays`: the
    driver can send a request to an external overflow endpoint (the gateway); where it cannot
    (the simulator), such a divert is refused as the pool would have refused it; `claims`: several
    gateways share the replicas, and a dispatch with a claim is claimed first."""

    def __init__(self, core: AdmissionCore, quotas: QuotaSettler | None = None, *, relays: bool = True,
                 claims: bool = False) -> None:
        self.core = core
        self.quotas = quotas
        self.relays = relays
        self.claims = claims
        self.live: set[str] = set()  # dispatched and being served: their permits are renewed
        self._trips: dict[str, _Trip] = {}
        self.renew_every = core.config.policy.permit_lease_s / 4
        self.next_renewal = 0.0

    # -- decisions in, steps out ------------------------------------------------------------------
    def offer(self, info: RequestInfo, now: float, checked: Tenant | None = None) -> list[Step]:
        self._trips[info.request_id] = _Trip(info)
        return self.steps(self.core.offer(info, now, checked), now)

    def steps(self, events: Iterable[Event], now: float) -> list[Step]:
        """What the drivers do about the core's events."""
        out: list[Step] = []
        for e in events:
            if isinstance(e, Dispatch):
                trip = self._trips.get(e.request_id)
                via = trip.via if trip is not None else None
                if self.claims and e.claim is not None:
                    out.append(Claim(e, via))
                else:
                    out.append(self._go(e, trip))
            elif isinstance(e, Divert):
                out.extend(self._diverted(e, now))
            elif isinstance(e, Reject):
                out.append(self._refuse(e))
            else:
                out.append(e)
        return out

    def claimed(self, d: Dispatch, others: int | None, now: float) -> list[Step]:
        """What the other gateways hold on `d`'s replica (None: the claim holds): filled first,
        it is held again until it fits."""
        if others is None:
            return [self._go(d, self._trips.get(d.request_id))]
        return self.steps(self.core.unclaimed(d.request_id, others, now), now)

    def requeue(self, rid: str, now: float, retry_after: float | None = None) -> list[Step]:
        """Its replica refused it before its client saw anything: held again until it fits elsewhere."""
        self.live.discard(rid)
        trip = self._trips.get(rid)
        if trip is not None:
            trip.dispatch = None
        return self.steps(self.core.requeue(rid, now, retry_after), now)

    def _go(self, d: Dispatch, trip: _Trip | None) -> Go:
        self.live.add(d.request_id)
        if trip is not None:
            trip.dispatch = d
        return Go(d, trip.via if trip is not None else None)

    def _refuse(self, e: Reject) -> Refuse:
        trip = self._trips.pop(e.request_id, None)
        self._settle(e.request_id, 0, 0)
        return Refuse(e, trip.via if trip is not None else None)

    def _diverted(self, e: Divert, now: float) -> list[Step]:
        trip = self._trips.get(e.request_id)
        target = None if trip is None else self._target(trip.info.model, e.target)
        refused = Reject(e.request_id, e.refusal, Terminal.REFUSED, e.tenant, e.band)
        if trip is None or target is None or trip.via is not None:  # a target pool never diverts again
            return [self._refuse(refused)]
        if target.model is None:
            if not self.relays:
                return [self._refuse(refused)]
            trip.relayed_to = target.name
            return [Relay(e, target)]
        # another model's pool: admitted there as usual
        trip.via = Via(target.name, str(e.refusal.reason))
        trip.info = replace(trip.info, model=target.model, diverted_from=trip.info.model, over_quota=None)
        return self.steps(self.core.offer(trip.info, now), now)

    def _target(self, model: str, name: str) -> OverflowTarget | None:
        for m in self.core.config.models:
            if m.name == model:
                return next((t for t in m.overflow if t.name == name), None)
        return None

    # -- what the driver saw ----------------------------------------------------------------------
    def started(self, rid: str, now: float, measured: bool = True) -> None:
        """Its first token came (`measured`: at the time the driver saw it)."""
        trip = self._trips.get(rid)
        if trip is not None and trip.first_token_at is None:
            trip.first_token_at = now
        self.core.started(rid, now, measured)

    def handed_over(self, rid: str, now: float) -> list[Step]:
        """Its prefill worker is done: its KV goes to its decode worker."""
        return self.steps(self.core.handed_over(rid, now), now)

    def finished(self, rid: str, now: float, out: Outcome) -> list[Step]:
        """An admitted request is over: its permit goes back, and its quota is settled at the
        price of whoever served it."""
        self.live.discard(rid)
        trip = self._trips.pop(rid, None)
        if trip is not None:
            self._settle(rid, *settlement(out, trip.info.prompt_tokens, trip.dispatch, now),
                         overflow=trip.via.target if trip.via is not None else None)
        return self.steps(self.core.finished(rid, now, out.terminal, out.completion_tokens, out.reason), now)

    def cancel(self, rid: str, now: float) -> list[Step]:
        """Its client left while it was held."""
        self.live.discard(rid)
        self._trips.pop(rid, None)
        self._settle(rid, 0, 0)
        return self.steps(self.core.cancel(rid, now), now)

    def relayed(self, rid: str, out: Outcome) -> None:
        """A request relayed to an external endpoint is over (the core counted it when it
        diverted it): its quota is settled at the target's price."""
        trip = self._trips.pop(rid, None)
        if trip is not None:
            self._settle(rid, *settlement(out, trip.info.prompt_tokens, None, 0.0), overflow=trip.relayed_to)

    def forget(self, rid: str) -> None:
        """Its driver dropped it on a path that is not a request's end (an error in the driver):
        whatever it reserved goes back."""
        self.live.discard(rid)
        if self._trips.pop(rid, None) is not None:
            self._settle(rid, 0, 0)

    def _settle(self, rid: str, prompt: int, completion: int | None, overflow: str | None = None) -> None:
        if self.quotas is not None:
            self.quotas.settle(rid, prompt, completion, overflow)

    # -- leases -----------------------------------------------------------------------------------
    def renew(self, now: float) -> None:
        """The permits of what is being served are kept, every quarter of a lease."""
        if now >= self.next_renewal:
            self.next_renewal = now + self.renew_every
            self.core.renew(self.live, now)

    @property
    def held(self) -> int:
        """Requests between their offer and their end."""
        return len(self._trips)
