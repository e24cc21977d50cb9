"""The one place a request ends.

Every terminal outcome — refused at any layer, evicted, expired, cancelled, completed, failed,
reclaimed, diverted — goes through a `Finaliser` method, which counts it once and settles what earlier
layers took for it:
- the tenant's breaker: a completion records success (or, for a runaway that ran into the
  context limit, failure), an upstream timeout records failure; a half-open probe that ended any
  other way gives its turn back;
- the tenant's rate limits: a served request's token charge is settled at what it used (`finish`);
  a charge is refunded when the request leaves without ever reaching
  an engine (refused by a later layer, expired, evicted, cancelled while queued);
- the retry ledger: a completed request is forgotten, so the same prompt later is a new request;
- its permit, when it held one: released on its replica and tenant (`PermitStore`);
- the waiting room's departure rate, when it left the waiting room (for Retry-After), and how
  long it waited there (whether its queue stands: `bouncer.core.flow.standing_queue`);
- its band's misses, when it was refused or expired as late (`band_slos.BandSLOs.missed`).

A refusal the model's overflow may take instead (`bouncer.core.fleet.overflow`) ends as a
`Divert`: the request goes there, counted as diverted (with the reason it did not stay), and
keeps its rate-limit charge (it is served, elsewhere).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bouncer.core.fleet.overflow import Overflow
from bouncer.core.fleet.permits import PermitStore
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.flow.backlog import BacklogStore
from bouncer.core.flow.queues import FlowQueues
from bouncer.core.intake.breaker import CircuitBreaker
from bouncer.core.intake.rate_limit import RateLimitStore
from bouncer.core.intake.retries import RetryStore
from bouncer.core.outcomes import LATE_REASONS, Divert, Layer, Reason, Reclaimed, Refusal, Reject, Terminal
from bouncer.core.requests import Admission, RequestInfo

if TYPE_CHECKING:
    from bouncer.core.model_state import ModelState

UNKNOWN_TENANT = "-"
NEVER_DISPATCHED = (Terminal.REFUSED, Terminal.EXPIRED, Terminal.EVICTED, Terminal.CANCELLED)


@dataclass(slots=True)
class CoreStats:
    offered: int = 0
    arrived: Counter = field(default_factory=Counter)  # tenant -> requests offered (UNKNOWN_TENANT: no key)
    outcomes: Counter = field(default_factory=Counter)  # Terminal -> count
    # (outcome, layer, reason, tenant, band) -> count; outcome "admitted" counts dispatches
    decisions: Counter = field(default_factory=Counter)
    slo_met: Counter = field(default_factory=Counter)  # tenant -> completed within SLO
    slo_total: Counter = field(default_factory=Counter)  # tenant -> completed with an SLO
    served_tokens: Counter = field(default_factory=Counter)  # tenant -> prompt + output tokens
    reclaimed: int = 0  # permits taken back after their lease ran out

    def arrive(self, tenant: str) -> None:
        self.offered += 1
        self.arrived[tenant] += 1

    def note(self, outcome: str, layer: str, reason: str, tenant: str, band: int | None) -> None:
        """A decision that is not an end (admitted, demoted, requeued)."""
        self.decisions[(outcome, layer, reason, tenant, band)] += 1

    def count_slo(self, adm: Admission, now: float, completion_tokens: int) -> None:
        """A completed request with an SLO: whether it met it (goodput), TTFT from its arrival."""
        if adm.ttft_slo is None and adm.tpot_slo is None:
            return
        self.slo_total[adm.tenant] += 1
        first = adm.first_token_at if adm.first_token_at is not None else now
        ok = adm.ttft_slo is None or first - adm.arrival <= adm.ttft_slo
        if ok and adm.tpot_slo is not None and completion_tokens > 1:
            ok = (now - first) / (completion_tokens - 1) <= adm.tpot_slo
        if ok:
            self.slo_met[adm.tenant] += 1


class Finaliser:
    def __init__(self, stats: CoreStats, permits: PermitStore, rate_limits: RateLimitStore,
                 backlog: BacklogStore, breakers: dict[str, CircuitBreaker], replicas: dict[str, ReplicaState],
                 models: dict[str, ModelState]) -> None:
        self.stats = stats
        self.permits = permits
        self.rate_limits = rate_limits
        self.backlog = backlog
        self.breakers = breakers  # tenant -> its breaker
        self.replicas = replicas
        self.models = models  # the core's, by name: whose queues stand
        self.retries: RetryStore | None = None  # set by the core's reload
        self.overflow = Overflow()  # reconfigured by the core's reload

    # -- before the request was admitted to a layer that takes anything ------------------------
    def refuse_unadmitted(self, request_id: str, tenant: str, band: int | None, refusal: Refusal,
                          model: str | None = None, now: float | None = None) -> Reject:
        """Refused before any layer took anything for it (who it is, validation, context, the
        gate refusing; `model` and `now` where it may have been refused as late: the precheck)."""
        if model is not None and now is not None and band is not None:
            self._missed(model, band, refusal.reason, now)
        self._count(Terminal.REFUSED, refusal.layer, refusal.reason, tenant, band)
        return Reject(request_id, refusal, Terminal.REFUSED, tenant, band)

    def divert_unadmitted(self, info: RequestInfo, tenant: str, band: int, refusal: Refusal, max_tokens: int,
                          now: float) -> Reject | Divert:
        """`refuse_unadmitted`, for a request an overflow target may take instead (a spent
        quota's `divert`), with the token limit it runs with."""
        divert = self._divert(info, tenant, band, refusal, max_tokens, now)
        return divert if divert is not None else self.refuse_unadmitted(info.request_id, tenant, band, refusal,
                                                                         info.model, now)

    def _divert(self, info: RequestInfo, tenant: str, band: int | None, refusal: Refusal, max_tokens: int,
                now: float) -> Divert | None:
        """A Divert in place of `refusal`, where an overflow target takes it (counted here)."""
        if info.diverted_from is not None:
            return None
        target = self.overflow.target(info.model, tenant, refusal.reason, now)
        if target is None:
            return None
        self._count(Terminal.DIVERTED, refusal.layer, refusal.reason, tenant, band)
        return Divert(info.request_id, target.name, refusal, tenant, band, max_tokens)

    # -- an Admission exists: it may hold a breaker probe and a rate-limit charge ----------------
    def refuse(self, adm: Admission, refusal: Refusal | Callable[[], Refusal], now: float,
               terminal: Terminal = Terminal.REFUSED, flow: FlowQueues | None = None) -> Reject | Divert:
        """It ends with `refusal`, taken out of `flow` first if queued there (a callable refusal
        is made after that, so that its Retry-After counts the waiting room without it)."""
        if flow is not None and flow.remove(adm):
            self._departed(adm, now)
        if callable(refusal):
            refusal = refusal()
        if not adm.best_effort:
            self._missed(adm.info.model, adm.priority, refusal.reason, now)
        divert = self._divert(adm.info, adm.tenant, adm.priority, refusal, adm.max_tokens, now)
        if divert is not None:
            self._settle(adm, Terminal.DIVERTED, refusal.reason, now, completion_tokens=0)
            return divert
        self._count(terminal, refusal.layer, refusal.reason, adm.tenant, adm.priority)
        self._settle(adm, terminal, refusal.reason, now, completion_tokens=0)
        return Reject(adm.request_id, refusal, terminal, adm.tenant, adm.priority)

    def cancel_queued(self, adm: Admission, flow: FlowQueues, now: float) -> None:
        """Its client went away while it was queued."""
        if flow.remove(adm):
            self._departed(adm, now)
        self._count(Terminal.CANCELLED, Layer.FLOW, Reason.CLIENT_DISCONNECTED, adm.tenant, adm.priority)
        self._settle(adm, Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED, now, completion_tokens=0)

    def dispatched(self, adm: Admission, flow: FlowQueues, now: float) -> None:
        """It leaves the waiting room for a replica (not an end: it holds a permit now)."""
        flow.remove(adm)
        self._departed(adm, now, dispatched=True)
        self.backlog.note_dispatch(adm.info.model, now)
        ms = self.models.get(adm.info.model)
        if ms is not None:
            ms.backlog.comebacks.dispatched(adm.tenant, adm.arrival, now)

    # -- an admitted request, holding a permit ----------------------------------------------------
    def finish(self, request_id: str, terminal: Terminal, reason: str | None, now: float,
               completion_tokens: int | None = 0) -> Admission | None:
        """It is over (completed, failed upstream, or cancelled mid-stream): its permit is
        released, and its token charge settled at what it used (`completion_tokens` None: the
        shell did not see it, and the charge stands). Returns it (None for an id that holds none,
        which is ignored: a shell may call this from every exit path)."""
        adm = self.permits.release(request_id, self.replicas)
        if adm is None:
            return None
        layer = Layer.UPSTREAM.value if terminal is Terminal.FAILED else "-"
        self._count(terminal, layer, reason or "-", adm.tenant, adm.priority)
        self._settle(adm, terminal, reason, now, completion_tokens or 0)
        if adm.rate_charge and completion_tokens is not None:
            self.rate_limits.settle(adm.tenant, adm.rate_charge, adm.info.prompt_tokens + completion_tokens, now)
        return adm

    def reclaim(self, adm: Admission, now: float) -> Reclaimed:
        """Its lease ran out unrenewed: the shell lost it."""
        self.permits.release(adm.request_id, self.replicas)
        self.stats.reclaimed += 1
        self.stats.note("reclaimed", "-", "lease_expired", adm.tenant, adm.priority)
        self._settle(adm, Terminal.FAILED, "lease_expired", now, completion_tokens=0)
        return Reclaimed(adm.request_id, adm.tenant, adm.priority, adm.replica or "-",  # type: ignore[arg-type]
                         now - (adm.dispatched_at or now))

    # -- the settling ---------------------------------------------------------------------------
    def _count(self, terminal: Terminal, layer: str, reason: str, tenant: str, band: int | None) -> None:
        self.stats.outcomes[terminal] += 1
        self.stats.decisions[(terminal.value, str(layer), str(reason), tenant, band)] += 1

    def _missed(self, model: str, band: int, reason: Reason | str, now: float) -> None:
        """Refused or expired as late: its band missed (the reserve lower bands leave it grows)."""
        ms = self.models.get(model)
        if ms is not None and reason in LATE_REASONS:
            ms.band_slos.missed(band, now)

    def _departed(self, adm: Admission, now: float, dispatched: bool = False) -> None:
        if adm.arrival < now:  # one that left as it arrived was never part of a backlog
            self.backlog.note_departure(adm.info.model, now)
        elif not dispatched:  # refused as it arrived: it says nothing of how long the queue makes one wait
            return
        ms = self.models.get(adm.info.model)
        if ms is not None and adm.ttft_slo and not adm.best_effort:
            ms.standing.departed(adm.priority, adm.tenant, now - adm.arrival, adm.ttft_slo, now)

    def _settle(self, adm: Admission, terminal: Terminal, reason: str | None, now: float,
                completion_tokens: int) -> None:
        breaker = self.breakers.get(adm.tenant)
        if breaker is not None:
            if terminal is Terminal.COMPLETED:
                # a sequence that ran into the context limit is a runaway: it counts against the breaker
                if adm.info.prompt_tokens + completion_tokens >= adm.context_limit:
                    breaker.record_failure(now)
                else:
                    breaker.record_success(now)
            elif terminal is Terminal.FAILED and reason == Reason.UPSTREAM_TIMEOUT:
                breaker.record_failure(now)
            elif adm.breaker_probe:
                breaker.release_probe()
        if adm.rate_charge and terminal in NEVER_DISPATCHED and adm.dispatched_at is None:
            self.rate_limits.refund(adm.tenant, adm.rate_charge, now)
            adm.rate_charge = 0
        if terminal is Terminal.COMPLETED and self.retries is not None and adm.retry_key is not None:
            self.retries.completed(adm.retry_key)
