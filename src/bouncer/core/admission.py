"""The admission core: for each request, admit it now, hold it, or shed it.

Pure and synchronous: every entry point takes `now` (seconds, any monotonic origin) and returns
the decisions it made as events. No IO, no clock, no sleeping; the asyncio gateway and the
virtual-time simulator drive the very same object.

Entry points (all return `list[Event]`):
- `offer(info, now)`: a new request. Refused at the first layer that refuses it, else queued;
  it may be dispatched at once (a `Dispatch` event for it) or later.
- `tick(now)`: expire queued requests past their TTL and dispatch what now fits. Call it at
  `next_wakeup()` at the latest.
- `started(id, now)`: first token seen. `finished(id, now, terminal, ...)`: the request is over
  (completed, failed upstream, or cancelled mid-stream); its permit returns and room may open.
- `cancel(id, now)`: the client left while queued. `observe(replica, telemetry, now)`: a scrape.
- `drain(model)` / `undrain(model)`: model swaps.

Concurrency model: one writer. The shell calls these from one thread (the event loop).
"""

from __future__ import annotations

import enum
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

from bouncer.config import BouncerConfig, ModelConfig, Tenant
from bouncer.core.agents import AgentWindow
from bouncer.core.blocks import num_blocks
from bouncer.core.breaker import CircuitBreaker
from bouncer.core.fleet import ReplicaState, Telemetry
from bouncer.core.flow import (
    FCFS,
    EarliestDeadline,
    FairnessPolicy,
    FlowQueues,
    OrderingPolicy,
    RoundRobin,
    TenantQueue,
    WeightedDeficitRoundRobin,
)
from bouncer.core.kv_events import KVEvent
from bouncer.core.latency import LatencyPredictor, StepTimeModel, prefill_pairs
from bouncer.core.outcomes import Layer, Refusal, Terminal
from bouncer.core.output_length import OutputLengthModel
from bouncer.core.rate_limit import TenantRateLimiter
from bouncer.core.requests import STEP_ACTIVE, STEP_OTHER, STEP_RETURNING, Admission, RequestInfo
from bouncer.core.retries import RetryLedger
from bouncer.core.routing import Router, cached_tokens, make_router

AGENT_LOOKAHEAD = 16  # queued requests of a tenant looked at for an agent step that may go now
RETRY_AFTER_MIN_S = 0.1  # sub-second values reach clients as `retry-after-ms` (the OpenAI SDKs read it)
RETRY_AFTER_MAX_S = 60.0
SERVICE_RATE_WINDOW_S = 30.0  # completions used to estimate how fast the fleet drains a backlog
MIN_COMPLETIONS_FOR_RATE = 10  # fewer than this in the window: no estimate (no refusal on a guess)
UNKNOWN_TENANT = "-"
BAND_ACTIVE_S = 10.0  # a band that sent a request this recently has its TTFT protected from lower bands


@dataclass(slots=True)
class Dispatch:
    """Send this request to `adm.replica` now."""

    adm: Admission


@dataclass(slots=True)
class Reject:
    """This request ends here with an error (refused, expired in the queue, or evicted)."""

    request_id: str
    refusal: Refusal
    terminal: Terminal
    tenant: str
    priority: int | None


@dataclass(slots=True)
class Reclaimed:
    """An admitted request's permit outlived its lease without the shell renewing it: the core
    took it back (a lost permit in the shell costs a slot for a while, not the fleet for ever)."""

    adm: Admission
    age_s: float


Event = Dispatch | Reject | Reclaimed


@dataclass(slots=True)
class CoreStats:
    offered: int = 0
    outcomes: Counter = field(default_factory=Counter)  # Terminal -> count
    # (outcome, layer, reason, tenant, band) -> count; outcome "admitted" counts dispatches
    decisions: Counter = field(default_factory=Counter)
    slo_met: Counter = field(default_factory=Counter)  # tenant -> completed within SLO
    slo_total: Counter = field(default_factory=Counter)  # tenant -> completed with an SLO
    served_tokens: Counter = field(default_factory=Counter)  # tenant -> prompt + output tokens
    reclaimed: int = 0  # permits taken back after their lease ran out


class _TenantState:
    def __init__(self, cfg: Tenant, policy_cfg, now: float) -> None:
        self.apply(cfg, policy_cfg, now)
        self.inflight_blocks = 0
        self.output_models: dict[str, OutputLengthModel] = {}

    def apply(self, cfg: Tenant, policy_cfg, now: float) -> None:
        rl = cfg.rate_limit
        self.cfg = cfg
        self.limiter = TenantRateLimiter(rl.requests_per_s, rl.request_burst, rl.tokens_per_min,
                                         rl.token_burst, now)
        b = policy_cfg.breaker
        self.breaker = CircuitBreaker(b.failures, b.window_s, b.open_s)


class _Room(enum.Enum):
    YES = "yes"
    LATER = "later"  # usable but full for now: only a warm prefix may justify sending it there
    NO = "no"


@dataclass(frozen=True, slots=True)
class _Late:
    """`_place`'s answer for a request no replica can serve within its TTFT deadline."""

    by_s: float  # predicted lateness on the best replica


class _ModelState:
    def __init__(self, cfg: ModelConfig, flow: FlowQueues) -> None:
        self.cfg = cfg
        self.flow = flow
        self.draining = False
        self.replicas: dict[str, ReplicaState] = {}
        self.completions: deque[float] = deque()  # completion times in the last window: the drain rate
        self.agents: AgentWindow | None = None  # agent-level admission, when enabled
        self.tpot_target: float | None = None  # strictest TPOT SLO of its tenants, with margin
        self.band_ttft: dict[int, tuple[float, float]] = {}  # band -> (strictest recent TTFT SLO, last arrival)
        self.band_tpot: dict[int, tuple[float, float]] = {}  # the same for TPOT SLOs


def _tighter(asked: float | None, configured: float | None) -> float | None:
    """The stricter of a client's SLO and its tenant's (either may be unset)."""
    if asked is None or configured is None:
        return configured if asked is None else asked
    return min(asked, configured)


def backend_name(model: str, index: int, explicit: str | None) -> str:
    return explicit or f"{model}/{index}"


def _backend_blocks(model: ModelConfig, backend) -> int | None:
    if backend.kv_blocks:
        return backend.kv_blocks
    if backend.kv_cache_gb and model.kv:
        return int(backend.kv_cache_gb * 1e9 / model.kv.bytes_per_token) // model.block_size
    return None


class AdmissionCore:
    def __init__(self, config: BouncerConfig, now: float) -> None:
        self.router: Router
        self._routing_cfg = None  # the routing config the router was built from
        self.stats = CoreStats()
        self.inflight: dict[str, Admission] = {}
        self._seq = itertools.count()
        self.models: dict[str, _ModelState] = {}
        self.tenants: dict[str, _TenantState] = {}
        self.replicas: dict[str, ReplicaState] = {}
        self._retries: RetryLedger | None = None  # first attempts, with policy.retries.deadline first-attempt
        self._next_lease_check = now
        self.reload(config, now)

    # -- configuration ------------------------------------------------------------------------
    def reload(self, config: BouncerConfig, now: float) -> list[Event]:
        """Apply a new config without touching queued or in-flight requests. Rate-limit and
        breaker state restart for changed tenants; replicas no longer listed finish their work
        and get nothing new."""
        self.config = config
        self.policy = config.policy
        if self.policy.routing != self._routing_cfg:  # a router's state (turns, trees) survives other reloads
            self.router = make_router(self.policy.routing.router, self.policy.routing)
        self._routing_cfg = self.policy.routing
        self._key_to_tenant = config.tenant_by_key()
        self._default_tenant = next((t for t in config.tenants if t.name == config.default_tenant), None)
        retries = self.policy.retries
        if retries.deadline == "first-attempt":
            if self._retries is None:
                self._retries = RetryLedger(retries.remember_s, retries.max_remembered)
            self._retries.remember_s, self._retries.max_entries = retries.remember_s, retries.max_remembered
        else:
            self._retries = None
        for t in config.tenants:
            state = self.tenants.get(t.name)
            if state is None:
                self.tenants[t.name] = _TenantState(t, self.policy, now)
            elif state.cfg != t:
                state.apply(t, self.policy, now)
        self._fairness: FairnessPolicy = (WeightedDeficitRoundRobin(self.policy.wdrr_quantum_tokens)
                                          if self.policy.fairness == "wdrr" else RoundRobin())
        self._ordering: OrderingPolicy = EarliestDeadline() if self.policy.ordering == "edf" else FCFS()
        for m in config.models:
            ms = self.models.get(m.name)
            if ms is None:
                ms = self.models[m.name] = _ModelState(m, FlowQueues(self._fairness, self._ordering))
            ms.cfg = m
            agents_cfg = self.policy.agents
            if not agents_cfg.enabled:
                ms.agents = None
            elif ms.agents is None:
                ms.agents = AgentWindow(agents_cfg)
            else:
                ms.agents.cfg = agents_cfg  # keeps its window and its active agents
            slos = [t.slo.tpot_s for t in config.tenants if t.slo.tpot_s and (not t.models or m.name in t.models)]
            ms.tpot_target = min(slos) * self.policy.tpot_guard_margin if slos else None
            ms.flow.fairness = self._fairness  # queued requests keep their order keys
            step = m.step_time
            step_model = StepTimeModel(step.a, step.b, step.c, step.max_batched_tokens, step.d) if step else None
            listed = set()
            for i, b in enumerate(m.backends):
                name = backend_name(m.name, i, b.name)
                listed.add(name)
                r = ms.replicas.get(name)
                if r is None:
                    r = ms.replicas[name] = ReplicaState(name, m.name, b.url, _backend_blocks(m, b), m.block_size)
                    self.replicas[name] = r
                r.url, r.configured_blocks, r.removed = b.url, _backend_blocks(m, b), False
                r.offload_blocks = b.kv_offload_blocks
                r.prefix.events_staleness_s = self.policy.routing.kv_events_staleness_s
                if step_model is None:
                    r.latency = None
                elif r.latency is None or r.latency.model != step_model:  # else keeps its corrections
                    r.latency = LatencyPredictor(step_model)
                r.sync_capacity()
            for name, r in ms.replicas.items():
                if name not in listed:
                    r.removed = True
        return self.tick(now)

    # -- the layers -------------------------------------------------------------------------------
    def offer(self, info: RequestInfo, now: float) -> list[Event]:
        self.stats.offered += 1
        tenant_state = self._key_to_tenant.get(info.key_digest) if info.key_digest else None
        tenant_state = tenant_state or self._default_tenant
        if tenant_state is None:
            return [self._refuse(info.request_id, UNKNOWN_TENANT, None, Layer.VALIDATION, "unauthenticated",
                                 "invalid or missing API key")]
        tenant = self.tenants[tenant_state.name]
        t = tenant.cfg
        band = t.priority

        def refuse(layer: Layer, reason: str, message: str, retry_after: float | None = None,
                   param: str | None = None) -> list[Event]:
            return [self._refuse(info.request_id, t.name, band, layer, reason, message, retry_after, param)]

        # layer 1: validation
        ms = self.models.get(info.model)
        if ms is None:
            return refuse(Layer.VALIDATION, "model_not_found", f"The model `{info.model}` does not exist.",
                          param="model")
        if t.models and info.model not in t.models:
            return refuse(Layer.VALIDATION, "model_not_allowed",
                          f"tenant {t.name!r} may not use model `{info.model}`", param="model")
        retry_key = first_arrival = None
        if self._retries is not None and info.prompt_digest is not None:
            retry_key = (t.name, info.model, info.prompt_digest, info.max_tokens)
            first_arrival = self._retries.arrived(retry_key, bool(info.retry_count), now)
        lim = self.config.limits
        if info.prompt_tokens < 1:
            return refuse(Layer.VALIDATION, "invalid_parameter", "the prompt is empty", param="prompt")
        if info.n < 1 or info.n > lim.max_n:
            return refuse(Layer.VALIDATION, "invalid_parameter", f"n must be between 1 and {lim.max_n}",
                          param="n")
        if info.best_of is not None and (info.best_of < 1 or info.best_of > lim.max_best_of):
            return refuse(Layer.VALIDATION, "invalid_parameter",
                          f"best_of must be between 1 and {lim.max_best_of}", param="best_of")
        if info.num_stop > lim.max_stop:
            return refuse(Layer.VALIDATION, "invalid_parameter", f"at most {lim.max_stop} stop sequences",
                          param="stop")
        if info.max_tokens is not None and info.max_tokens < lim.max_tokens_min:
            return refuse(Layer.VALIDATION, "invalid_parameter",
                          f"max_tokens must be at least {lim.max_tokens_min}", param="max_tokens")

        # layer 2: context budget; max_tokens defaulted and clamped
        max_tokens = t.max_tokens_default if info.max_tokens is None else min(info.max_tokens, t.max_tokens_cap)
        limit = min(ms.cfg.max_model_len, t.context_cap or ms.cfg.max_model_len)
        if info.prompt_tokens >= limit:
            return refuse(Layer.CONTEXT, "context_length_exceeded",
                          f"This model's maximum context length is {limit} tokens; the prompt has "
                          f"{info.prompt_tokens}.", param="messages")
        if info.prompt_tokens + max_tokens > limit:
            if info.max_tokens is not None and info.max_tokens <= t.max_tokens_cap:
                return refuse(Layer.CONTEXT, "context_length_exceeded",
                              f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{info.prompt_tokens + max_tokens} tokens ({info.prompt_tokens} in the prompt, "
                              f"{max_tokens} for the completion).", param="max_tokens")
            max_tokens = limit - info.prompt_tokens

        # rate limits and circuit breaker
        wait = tenant.breaker.allow(now)
        if wait is not None:
            return refuse(Layer.RATE, "circuit_open",
                          f"tenant {t.name!r} is paused after repeated upstream failures", wait)
        limited = tenant.limiter.check(info.prompt_tokens + max_tokens, now)
        if limited is not None:
            reason, wait = limited
            return refuse(Layer.RATE, reason, f"tenant {t.name!r} is over its {reason.split('_')[-1]} rate limit",
                          wait)

        ttl = t.queue_ttl_s or self.policy.default_ttl_s
        if info.ttl_s is not None:
            ttl = min(ttl, info.ttl_s)
        # a client's header may tighten its tenant's SLO, never loosen it
        ttft_slo = _tighter(info.ttft_slo_s, t.slo.ttft_s)
        # a retry's user has waited since its first attempt: what is left of its SLO
        ttft_left = ttft_slo - (now - first_arrival) if ttft_slo and first_arrival is not None else ttft_slo
        adm = Admission(info=info, tenant=t.name, priority=band, max_tokens=max_tokens,
                        expected_output=self._expected_output(tenant, info.model, max_tokens),
                        arrival=now, deadline=now + ttl,
                        ttft_deadline=now + ttft_left if ttft_slo else None, ttft_slo=ttft_slo,
                        tpot_slo=_tighter(info.tpot_slo_s, t.slo.tpot_s), seq=next(self._seq), retry_key=retry_key,
                        lease_until=now + self.policy.permit_lease_s)
        if ttft_slo:
            self._note_band_slo(ms.band_ttft, band, ttft_slo, now)
        if adm.tpot_slo:
            self._note_band_slo(ms.band_tpot, band, adm.tpot_slo, now)
        if ttft_slo and ttft_left <= 0:
            # its first attempt's deadline has passed: as its tenant says of infeasible requests
            adm.predicted_infeasible = True
            if t.slo.on_infeasible == "refuse" and self.acts_on_infeasible(adm):
                return refuse(Layer.SLO, "retry_past_deadline",
                              f"a retry {now - first_arrival:.2f} s after its first attempt, past that attempt's "
                              f"TTFT SLO ({ttft_slo:g} s): another retry cannot meet it")
            self._demote(adm)
            self.stats.decisions[("demoted", Layer.SLO.value, "retry_past_deadline", adm.tenant, adm.priority)] += 1
            ttft_slo = ttft_left = None
        fresh = self._freshness(ms, now)
        best_ttft = self._best_ttft(ms, adm, now, fresh) if ttft_slo else None
        if ttft_slo and self.policy.ttl_within_slo:
            # Waiting longer, it could only be served late: its queueing budget is what its SLO
            # leaves after the best predicted TTFT, with room for that prediction's error
            # (without a step-time model, a fixed share of the SLO).
            budget = (ttft_left - self.policy.ttft_safety_factor * best_ttft if best_ttft is not None
                      else ttft_left * self.policy.slo_queue_fraction)
            adm.deadline = min(adm.deadline, now + max(0.0, budget))
        if ms.agents is not None:
            adm.session = info.session_id or (info.user if self.policy.agents.session_from_user else None)
            if adm.session is not None:
                adm.queue_rank = (STEP_ACTIVE if ms.agents.is_active(adm.session) else
                                  STEP_RETURNING if ms.agents.is_returning(adm.session) else STEP_OTHER)

        # layers 4/5 at arrival: drain, usable backends, shedding, waiting-room bounds
        flow = ms.flow
        if ms.draining:
            if len(flow) >= self.policy.drain_queue_cap:
                return refuse(Layer.FLOW, "draining", f"model `{info.model}` is draining for a swap",
                              self.retry_after(ms, band, now, t.name))
        else:
            if not any(self._usable(r, fresh) for r in ms.replicas.values()):
                return refuse(Layer.QUEUE, "no_backend", f"no usable backend for model `{info.model}`",
                              self.retry_after(ms, band, now, t.name))
            if band < 0 and self._saturation(ms, now, fresh) >= self._ceiling(band):
                return refuse(Layer.FLOW, "saturated", "the fleet is saturated; sheddable traffic is refused",
                              self.retry_after(ms, band, now, t.name))
        events: list[Event] = []
        q = flow.tenant_queue(adm)
        qc = self.policy.queues
        if q is not None and (q.count >= qc.tenant_max_requests
                              or q.tokens + info.prompt_tokens > qc.tenant_max_tokens):
            return refuse(Layer.QUEUE, "tenant_queue_full", f"tenant {t.name!r} has too many queued requests",
                          self.retry_after(ms, band, now, t.name))
        band_state = flow.bands.get(band)
        while (len(flow) >= qc.max_requests or flow.tokens + info.prompt_tokens > qc.max_tokens
               or (band_state is not None and band_state.count >= qc.band_max_requests)):
            victim = flow.lowest_sheddable(below=band)
            if victim is None:
                return refuse(Layer.QUEUE, "queue_full", "the waiting room is full",
                              self.retry_after(ms, band, now, t.name))
            flow.remove(victim, now)
            events.append(self._refuse(victim.request_id, victim.tenant, victim.priority, Layer.FLOW, "evicted",
                                       "evicted from the queue by higher-priority traffic",
                                       self.retry_after(ms, victim.priority, now, victim.tenant),
                                       terminal=Terminal.EVICTED))
        flow.push(adm, t.weight)
        events.extend(self._dispatch(ms, now))
        if adm.queue_rank == STEP_OTHER and adm.session is not None and info.request_id in flow:
            events.extend(self._agent_outwaits_ttl(ms, adm, now))
        if ttft_slo and not ms.draining and info.request_id in flow and adm.ttft_deadline is not None:
            # It has to wait. If the backlog ahead and the prefill work on the best replica already
            # add up to more than its TTFT SLO, say so now (before any prefill), and when to come
            # back: once enough of it has drained.
            late = self._predicted_late_by(ms, adm, ttft_left, best_ttft, now)
            if late is not None:
                events.extend(self._infeasible(ms, adm, now, late))
        return events

    def _best_ttft(self, ms: _ModelState, adm: Admission, now: float, fresh: dict[str, bool]) -> float | None:
        """The lowest TTFT predicted for `adm` on a usable replica, were it sent now (None
        without a step-time model)."""
        ttfts = [ttft for r in ms.replicas.values() if self._usable(r, fresh)
                 and (ttft := r.predict_ttft(adm, adm.info.prompt_tokens - cached_tokens(r, adm, now))) is not None]
        return min(ttfts) if ttfts else None

    def _predicted_late_by(self, ms: _ModelState, adm: Admission, ttft_left: float, best_ttft: float | None,
                           now: float) -> float | None:
        """How far past its TTFT deadline (`ttft_left` from now) a queued newcomer is predicted
        to start (None: in time, or no estimate): the wait in the gateway's queue, then the best
        predicted TTFT, from the prefill work on the replica, x ttft_safety_factor. Without a
        step-time model: the wait (to its first token) against slo_queue_fraction of what is left."""
        if best_ttft is None:
            wait = self.estimated_wait(ms, adm.priority, now, adm.tenant)
            budget = ttft_left * self.policy.slo_queue_fraction
            return wait - budget if wait is not None and wait > budget else None
        wait = self.queue_wait(ms, adm.priority, now, adm.tenant) or 0.0
        late = wait + self.policy.ttft_safety_factor * best_ttft - ttft_left
        return late if late > 0 else None

    def acts_on_infeasible(self, adm: Admission) -> bool:
        """Whether a request predicted to miss its deadline is refused or demoted (else only
        flagged). One seam, so a paired benchmark run can let one refused request through."""
        return self.policy.refuse_infeasible

    def _infeasible(self, ms: _ModelState, adm: Admission, now: float, late_by: float) -> list[Event]:
        """`adm` (queued) is predicted to miss its TTFT deadline: refuse it, or serve it
        best-effort, as its tenant says; with refuse_infeasible off, only flag it."""
        adm.predicted_infeasible = True
        if not self.acts_on_infeasible(adm):
            return []
        tenant = self.tenants[adm.tenant].cfg
        demoted = tenant.slo.on_infeasible == "best-effort"  # it stays in the waiting room, lower down
        ms.flow.remove(adm, None if demoted else now)
        if demoted:
            self._demote(adm)
            ms.flow.push(adm, tenant.weight)
            self.stats.decisions[("demoted", Layer.SLO.value, "deadline_infeasible", adm.tenant, adm.priority)] += 1
            return []
        # queued since an earlier call: it leaves the waiting room as an expiry, not a refusal
        terminal = Terminal.REFUSED if adm.arrival == now else Terminal.EXPIRED
        # when new work like it would fit: once what waits ahead of it now has been served (its
        # lateness alone says too little: arrivals go on, and with them the backlog; measured,
        # `retry_after_accuracy` in `bench run`)
        retry_after = max(RETRY_AFTER_MIN_S, late_by, self.turnover_wait(ms, adm.priority, now, adm.tenant) or 0.0)
        return [self._refuse(adm.request_id, adm.tenant, adm.priority, Layer.SLO, "deadline_infeasible",
                             f"predicted to start ~{late_by:.2f} s past this request's TTFT SLO ({adm.ttft_slo:g} s)",
                             retry_after, terminal=terminal)]

    def _demote(self, adm: Admission) -> None:
        """`adm` (not queued) will run best-effort: in the best-effort band, without a TTFT
        deadline, until its TTL."""
        tenant = self.tenants[adm.tenant].cfg
        adm.best_effort = True
        adm.priority = min(adm.priority, self.policy.best_effort_priority)
        adm.ttft_deadline = None  # EDF now orders it by its TTL, no longer cut to the SLO
        ttl = tenant.queue_ttl_s or self.policy.default_ttl_s
        adm.deadline = adm.arrival + min(ttl, adm.info.ttl_s if adm.info.ttl_s is not None else ttl)

    def _agent_outwaits_ttl(self, ms: _ModelState, adm: Admission, now: float) -> list[Event]:
        """A new agent's first step waits for a slot in the window: if the agents waiting before
        it make that longer than its queue TTL, refuse it now, with the expected wait."""
        agents = ms.agents
        assert agents is not None
        ahead = sum(1 for s in ms.flow.waiting_sessions if s != adm.session and not agents.is_active(s))
        wait = agents.wait_for_slot(ahead, now)
        if wait is None or now + wait <= adm.deadline:
            return []
        ms.flow.remove(adm, now)
        return [self._refuse(adm.request_id, adm.tenant, adm.priority, Layer.FLOW, "agent_window_full",
                             f"{ahead} agents wait for a slot in the agent window before this one; "
                             f"expected wait ~{wait:.0f} s", wait)]

    # -- lifecycle of admitted requests -------------------------------------------------------
    def started(self, request_id: str, now: float) -> None:
        adm = self.inflight.get(request_id)
        if adm is None or adm.first_token_at is not None:
            return
        adm.first_token_at = now
        r = self.replicas[adm.replica]
        r.idle_refusals = 0
        if r.latency is not None and adm.ttft_raw is not None:
            r.latency.observe_ttft(adm.ttft_raw, now - adm.dispatched_at)  # type: ignore[operator]
        r.mark_started(adm)

    def finished(self, request_id: str, now: float, terminal: Terminal, completion_tokens: int = 0,
                 reason: str | None = None) -> list[Event]:
        """The admitted request is over. `reason` for FAILED names the failure (a key of
        outcomes.STATUS_BY_REASON, e.g. "upstream_timeout"). Unknown ids are ignored, so a
        shell may call this from every exit path."""
        adm = self.inflight.get(request_id)
        if adm is None:
            return []
        replica = self._release(adm, now)
        tenant = self.tenants.get(adm.tenant)
        self.stats.outcomes[terminal] += 1
        layer = Layer.UPSTREAM.value if terminal is Terminal.FAILED else "-"
        self.stats.decisions[(terminal.value, layer, reason or "-", adm.tenant, adm.priority)] += 1
        ms = self.models[adm.info.model]
        if terminal is Terminal.COMPLETED:
            if self._retries is not None and adm.retry_key is not None:
                self._retries.completed(adm.retry_key)
            self._on_completed(adm, tenant, ms, now, completion_tokens)
            self._adapt_inflight_limit(ms, replica, adm, now, completion_tokens)
            if replica.latency is not None and adm.tpot_raw is not None and adm.first_token_at is not None \
                    and completion_tokens > 1:
                replica.latency.observe_tpot(adm.tpot_raw, (now - adm.first_token_at) / (completion_tokens - 1))
        elif terminal is Terminal.FAILED and tenant is not None and reason == "upstream_timeout":
            tenant.breaker.record_failure(now)
        return self._dispatch(ms, now)

    def _on_completed(self, adm: Admission, tenant: _TenantState | None, ms: _ModelState, now: float,
                      completion_tokens: int) -> None:
        tokens = adm.info.prompt_tokens + completion_tokens
        self.stats.served_tokens[adm.tenant] += tokens
        ms.completions.append(now)
        self._trim_completions(ms, now)
        if tenant is None:
            return
        tenant.output_models.setdefault(adm.info.model, OutputLengthModel(self.policy.expected_output_default)) \
            .observe(completion_tokens)
        # A sequence that ran into the context limit is a runaway: it counts against the breaker.
        if adm.info.prompt_tokens + completion_tokens >= ms.cfg.max_model_len:
            tenant.breaker.record_failure(now)
        else:
            tenant.breaker.record_success(now)
        ttft_slo, tpot_slo = adm.ttft_slo, adm.tpot_slo
        if ttft_slo is None and tpot_slo is None:
            return
        self.stats.slo_total[adm.tenant] += 1
        first = adm.first_token_at if adm.first_token_at is not None else now
        ok = ttft_slo is None or first - adm.arrival <= ttft_slo
        if ok and tpot_slo is not None and completion_tokens > 1:
            ok = (now - first) / (completion_tokens - 1) <= tpot_slo
        if ok:
            self.stats.slo_met[adm.tenant] += 1

    def requeue(self, request_id: str, now: float, retry_after: float | None = None) -> list[Event]:
        """The replica refused the dispatched request (its own queue cap, a 503 or 429; its
        `retry_after`, if it said one): take the permit back and hold the request again at the
        front of its queue instead of passing the refusal on. It still leaves at its original TTL.

        The replica rests (`_rest`), and its in-flight limit is cut to what it holds, to grow
        back by one request per few completions (AIMD): an engine with a queue cap is then sent
        what it takes, not probed by every request. A request ends now with 503
        upstream_refused when no replica will take it: every usable one refuses everything
        (`upstream_refusal_retries` refusals in a row while running none of ours), or rests
        past this request's TTL."""
        adm = self.inflight.get(request_id)
        if adm is None:
            return []
        replica = self._release(adm, now)
        self._rest(replica, now, retry_after)
        ms = self.models[adm.info.model]
        usable = [r for r in ms.replicas.values() if not r.removed and r.healthy]
        wake = min((r.cooldown_until or now for r in usable), default=None)
        refuses_all = all(r.idle_refusals >= self.policy.upstream_refusal_retries for r in usable)
        if wake is None or wake > adm.deadline or refuses_all:
            self.stats.outcomes[Terminal.FAILED] += 1
            self.stats.decisions[(Terminal.FAILED.value, Layer.UPSTREAM.value, "upstream_refused", adm.tenant,
                                  adm.priority)] += 1
            refusal = Refusal(Layer.UPSTREAM, "upstream_refused", "no backend will take this request: they "
                              "refuse it for load, or rest longer than its queue TTL",
                              max(RETRY_AFTER_MIN_S, (wake or now + RETRY_AFTER_MIN_S) - now))
            return [Reject(request_id, refusal, Terminal.FAILED, adm.tenant, adm.priority), *self._dispatch(ms, now)]
        self.stats.decisions[("requeued", Layer.UPSTREAM.value, "upstream_refused", adm.tenant, adm.priority)] += 1
        adm.replica = None
        adm.dispatched_at = None
        adm.first_token_at = None
        adm.blocks = 0
        adm.prefill_tokens = 0
        ms.flow.push(adm, self.tenants[adm.tenant].cfg.weight)
        return self.tick(now)

    def _rest(self, r: ReplicaState, now: float, retry_after: float | None) -> None:
        """A replica refused a request: it gets nothing for `upstream_refusal_cooldown_s`
        (doubled for each refusal in a row while it runs nothing of ours: then it is not merely
        full), or for as long as its own Retry-After asked (both bounded); and no more in flight
        than it holds now, until completions let it grow."""
        p = self.policy
        if not r.inflight:
            r.idle_refusals += 1
        rest = p.upstream_refusal_cooldown_s * 2 ** min(20, max(0, r.idle_refusals - 1))
        if retry_after is not None:
            rest = max(rest, retry_after)
        r.cooldown_until = now + min(p.upstream_refusal_cooldown_max_s, rest)
        r.concurrency_limit = max(1.0, min(r.concurrency_limit, len(r.inflight)))
        r.refusals_cut_limit = True

    def _adapt_inflight_limit(self, ms: _ModelState, r: ReplicaState, adm: Admission, now: float,
                              tokens: int) -> None:
        """AIMD on a replica's in-flight limit. The TPOT guard drives it by the decode speed its
        completed requests saw: each request slower than its own TPOT SLO (x tpot_guard_margin;
        without one, the strictest among this model's tenants) cuts the limit to 80% of what was
        in flight (at most once per second); each fast one adds `tpot_guard_increase`. Its own
        SLO, not the strictest: a standard request running at its own 150 ms is no sign of
        trouble, and the TPOT hold already keeps batches within the strictest SLO running on each
        replica. A limit cut by refusals (`_rest`) grows back by the same step per completion."""
        p = self.policy
        target = adm.tpot_slo * p.tpot_guard_margin if adm.tpot_slo else ms.tpot_target
        guarded = p.tpot_guard and target is not None and adm.first_token_at is not None and tokens >= 2
        if guarded and (now - adm.first_token_at) / (tokens - 1) > target:  # type: ignore[operator]
            if now - r.last_cut >= 1.0:
                r.concurrency_limit = max(p.min_inflight_per_replica,
                                          min(r.concurrency_limit, len(r.inflight) + 1) * 0.8)
                r.last_cut = now
        elif (guarded or r.refusals_cut_limit) and r.concurrency_limit < p.max_inflight_per_replica:
            r.concurrency_limit += p.tpot_guard_increase

    def cancel(self, request_id: str, now: float) -> list[Event]:
        """The client went away while its request was queued: it leaves the queue at once."""
        for ms in self.models.values():
            adm = ms.flow.get(request_id)
            if adm is not None:
                ms.flow.remove(adm, now)
                self.stats.outcomes[Terminal.CANCELLED] += 1
                self.stats.decisions[("cancelled", Layer.FLOW.value, "client_disconnected", adm.tenant,
                                      adm.priority)] += 1
                return self._dispatch(ms, now)
        return []

    def observe(self, replica: str, telemetry: Telemetry | None, now: float) -> list[Event]:
        """A scrape result; None when the scrape failed (the replica counts as unhealthy)."""
        r = self.replicas.get(replica)
        if r is None:
            return []
        if telemetry is None:
            r.healthy = False
        else:
            r.healthy = True
            r.observe(telemetry)
            r.check_drift(telemetry, now, self.policy.inflight_drift_s)
        ms = self.models[r.model]
        if ms.agents is not None:
            self._observe_agents(ms, now)
        return self._dispatch(ms, now)

    def _observe_agents(self, ms: _ModelState, now: float) -> None:
        """The agent window's signals: pool KV usage, and the prefix-cache counters summed over
        the model's replicas (None unless every usable replica reports them)."""
        fresh = self._freshness(ms, now)
        usable = [r.telemetry for r in ms.replicas.values() if self._usable(r, fresh) and r.telemetry is not None]
        queries = hits = None
        if usable and all(t.prefix_queries is not None and t.prefix_hits is not None for t in usable):
            queries = sum(t.prefix_queries for t in usable)  # type: ignore[misc]
            hits = sum(t.prefix_hits for t in usable)  # type: ignore[misc]
        sizes = [t.num_blocks for t in usable]
        pool_blocks = sum(sizes) if sizes and all(sizes) else None  # type: ignore[arg-type]
        ms.agents.observe(self._pool_usage(ms, now, fresh), queries, hits, now, pool_blocks)  # type: ignore[union-attr]

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

    def tick(self, now: float) -> list[Event]:
        events: list[Event] = self._reclaim(now) if now >= self._next_lease_check else []
        for ms in self.models.values():
            for adm in ms.flow.expired(now):
                ms.flow.remove(adm, now)
                if ms.draining:  # held for a model swap that outlasted its TTL
                    reason, message = "draining", f"model `{adm.info.model}` is draining for a swap"
                else:
                    reason, message = "ttl_expired", "queued longer than its TTL"
                events.append(self._refuse(adm.request_id, adm.tenant, adm.priority, Layer.FLOW, reason, message,
                                           self.retry_after(ms, adm.priority, now, adm.tenant),
                                           terminal=Terminal.EXPIRED))
            events.extend(self._dispatch(ms, now))
        return events

    # -- permit leases --------------------------------------------------------------------------
    def renew(self, request_ids, now: float) -> None:
        """The shell still runs these admitted requests: their permits live on."""
        until = now + self.policy.permit_lease_s
        for rid in request_ids:
            adm = self.inflight.get(rid)
            if adm is not None:
                adm.lease_until = until

    def _reclaim(self, now: float) -> list[Event]:
        """Take back the permits whose lease ran out: the shell lost track of them. Checked a
        few times per lease, so a lost permit is back within 1.25 leases."""
        lease = self.policy.permit_lease_s
        self._next_lease_check = now + lease / 4
        lost = [adm for adm in self.inflight.values() if adm.lease_until < now]
        events: list[Event] = []
        for adm in lost:
            self._release(adm, now)
            self.stats.reclaimed += 1
            self.stats.decisions[("reclaimed", "-", "lease_expired", adm.tenant, adm.priority)] += 1
            events.append(Reclaimed(adm, now - (adm.dispatched_at or now)))
            events.extend(self._dispatch(self.models[adm.info.model], now))
        return events

    def next_wakeup(self) -> float | None:
        """When `tick` must run next at the latest: the earliest queue TTL, or the end of a
        replica's rest after a refusal while work is queued for it."""
        times = [d for ms in self.models.values() if (d := ms.flow.next_deadline()) is not None]
        times += [r.cooldown_until for r in self.replicas.values()
                  if r.cooldown_until is not None and len(self.models[r.model].flow)]
        times += [t for ms in self.models.values() if ms.agents is not None and len(ms.flow)  # an idle agent
                  and (t := ms.agents.next_expiry(ms.flow.waiting_sessions)) is not None]  # frees its slot
        return min(times) if times else None

    def drain(self, model: str) -> None:
        self._model(model).draining = True

    def undrain(self, model: str, now: float) -> list[Event]:
        ms = self._model(model)
        ms.draining = False
        return self._dispatch(ms, now)

    def _model(self, model: str) -> _ModelState:
        try:
            return self.models[model]
        except KeyError:
            raise ValueError(f"unknown model {model!r}") from None

    # -- dispatch -----------------------------------------------------------------------------------
    def _dispatch(self, ms: _ModelState, now: float) -> list[Event]:
        """Dispatch queued requests, highest band first, while they fit. A band that still has
        queued work blocks the bands below it: their requests would take the room it waits for."""
        events: list[Event] = []
        flow = ms.flow
        if ms.draining or not len(flow):
            return events
        fresh = self._freshness(ms, now)
        agents = ms.agents
        if agents is not None:
            agents.expire(now, flow.waiting_sessions)
        for band in flow.bands_desc():
            if not band.count:
                continue
            ceiling = self._ceiling(band.priority)
            skip: set[str] = set()
            while band.count:
                if self._saturation(ms, now, fresh) >= ceiling:
                    break
                q = self._fairness.pick(band, skip)
                if q is None:
                    break
                adm = q.head()
                if adm.session is not None and agents is not None:
                    # the head is an agent's step: if the window or its replica holds it, another
                    # agent's may go (agents of one tenant do not wait behind each other)
                    placed = self._next_agent_step(q, agents, ms, now, fresh)
                    if placed is None:
                        skip.add(q.tenant)
                        continue
                    adm, replica = placed
                else:
                    replica = self._place(ms, adm, now, fresh)
                if isinstance(replica, _Late):
                    events.extend(self._infeasible(ms, adm, now, replica.by_s))
                    continue
                if replica is None:
                    skip.add(q.tenant)  # its head waits; other tenants may still fit
                    continue
                self._fairness.charge(band, q, adm)
                flow.remove(adm, now)
                flow.dispatched(now)
                self._assign(adm, replica, now)
                events.append(Dispatch(adm))
            if band.count:
                break
        return events

    def _next_agent_step(self, q: TenantQueue, agents: AgentWindow, ms: _ModelState, now: float,
                         fresh: dict[str, bool]) -> tuple[Admission, ReplicaState | _Late] | None:
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
            newcomer = adm.session is not None and not agents.is_active(adm.session)
            if newcomer and in_line:
                continue
            if adm.session is None or agents.may_dispatch(adm.session, now, waiting):
                replica = self._place(ms, adm, now, fresh)
                if replica is not None:
                    return adm, replica
            in_line = in_line or newcomer
        return None

    def _assign(self, adm: Admission, replica: ReplicaState, now: float) -> None:
        adm.replica = replica.name
        adm.dispatched_at = now
        adm.lease_until = now + self.policy.permit_lease_s
        adm.blocks = num_blocks(adm.info.prompt_tokens + adm.expected_output, replica.block_size)
        adm.prefill_tokens = adm.info.prompt_tokens - cached_tokens(replica, adm, now)
        if replica.latency is not None:  # what it is predicted to see, kept to correct the predictor by
            adm.ttft_raw = replica.predict_ttft(adm, adm.prefill_tokens, raw=True)
            adm.tpot_raw = replica.predict_tpot(adm, now, raw=True)
            replica.latency.dispatched(adm.prefill_tokens, now)
        replica.prefix.record(adm.info.block_digests, now)
        replica.add(adm.request_id, adm, adm.blocks, adm.prefill_tokens)
        agents = self.models[adm.info.model].agents
        if adm.session is not None and agents is not None:
            agents.dispatched(adm.session, now, adm.blocks, replica.name)
        self.tenants[adm.tenant].inflight_blocks += adm.blocks
        self.inflight[adm.request_id] = adm
        self.stats.decisions[("admitted", "-", "-", adm.tenant, adm.priority)] += 1

    def _release(self, adm: Admission, now: float) -> ReplicaState:
        """Undo `_assign`: the permit, the replica's, the tenant's and the agent's accounting."""
        del self.inflight[adm.request_id]
        agents = self.models[adm.info.model].agents
        if adm.session is not None and agents is not None:
            agents.finished(adm.session, now)
        replica = self.replicas[adm.replica]
        if adm.first_token_at is None:
            replica.mark_started(adm)
        replica.remove(adm.request_id, adm.blocks)
        tenant = self.tenants.get(adm.tenant)
        if tenant is not None:
            tenant.inflight_blocks -= adm.blocks
        return replica

    def _place(self, ms: _ModelState, adm: Admission, now: float,
               fresh: dict[str, bool]) -> ReplicaState | _Late | None:
        """Layer 3: a replica with room for this request's KV, or None (hold it). With a TTFT
        deadline and predicted latencies, only replicas predicted to meet it qualify; LATE when
        none would (waiting would not help: the deadline nears as fast as the work ahead drains)."""
        if not self._pool_admits(ms, adm, now, fresh):
            return None
        candidates: list[ReplicaState] = []
        # usable, but full for now (prefill queue, KV headroom): only a replica
        # holding this prompt's prefix may still get it, if the router's stickiness gate allows
        backlogged: list[ReplicaState] = []
        cached = {r.name: cached_tokens(r, adm, now) for r in ms.replicas.values()}
        protected = (self._protected(ms.band_ttft, adm.priority, now), self._protected(ms.band_tpot, adm.priority, now))
        for r in ms.replicas.values():
            room = self._room(r, adm, cached[r.name], protected, now, fresh)
            if room is _Room.YES:
                candidates.append(r)
            elif room is _Room.LATER:
                backlogged.append(r)
        agents = ms.agents
        if adm.session is not None and agents is not None:
            home = agents.home(adm.session)
            if home is not None and cached[home] > 0:
                # an active agent's step goes where its context is, or waits for room there:
                # computed again elsewhere, its context would also evict another agent's
                r = ms.replicas[home]
                if r not in candidates and r not in backlogged:
                    return None
                candidates, backlogged = [r], []
            else:  # a new agent (or one whose context is gone): where the agents living there leave room
                candidates = [r for r in candidates if r.name == home or agents.room(r.name, r.capacity_blocks)
                              >= num_blocks(adm.info.prompt_tokens + adm.expected_output, r.block_size)]
        if not candidates:
            return None
        if adm.ttft_deadline is not None and candidates[0].latency is not None:
            budget = adm.ttft_deadline - now
            ttfts = [r.predict_ttft(adm, adm.info.prompt_tokens - cached[r.name]) or 0.0 for r in candidates]
            in_time = [r for r, ttft in zip(candidates, ttfts, strict=True) if ttft <= budget]
            if not in_time:
                if self.acts_on_infeasible(adm):
                    return _Late(min(ttfts) - budget)
                adm.predicted_infeasible = True  # only flagged: it goes where the router says
            else:
                candidates = in_time
                backlogged = [r for r in backlogged
                              if (r.predict_ttft(adm, adm.info.prompt_tokens - cached[r.name]) or 0.0) <= budget]
        return self.router.choose(adm, candidates, now, fresh, self.policy.prefill_busy_tokens, backlogged)

    def _pool_admits(self, ms: _ModelState, adm: Admission, now: float, fresh: dict[str, bool]) -> bool:
        """The checks that look at the whole pool: context squeeze under pressure, KV shares."""
        p = self.policy
        total = adm.info.prompt_tokens + adm.max_tokens
        pressure = self._pool_usage(ms, now, fresh)
        if pressure > p.context_pressure_start:
            t = self.tenants[adm.tenant].cfg
            cap = t.context_cap or ms.cfg.max_model_len
            squeeze = min(1.0, (pressure - p.context_pressure_start) / max(1e-9, 1 - p.context_pressure_start))
            if total > cap * (1 - (1 - p.context_pressure_min_fraction) * squeeze):
                return False  # long requests wait while the pool is under pressure
        return self._within_kv_share(ms, adm, now, fresh)

    def _room(self, r: ReplicaState, adm: Admission, cached: int, protected: tuple[float, float], now: float,
              fresh: dict[str, bool]) -> _Room:
        """Whether `r` can take `adm` now, `cached` of its prompt tokens being cached there and
        `protected` the TTFT and TPOT SLOs of a higher band it must leave room for; updates the
        replica's busy hysteresis and cooldown."""
        p = self.policy
        protected_ttft, protected_tpot = protected
        if not self._usable(r, fresh):
            return _Room.NO
        if r.cooldown_until is not None:
            if now < r.cooldown_until:
                return _Room.NO
            r.cooldown_until = None
        usage = self._usage(r, now, fresh[r.name])
        if r.busy and usage < p.kv_resume_threshold:
            r.busy = False
        elif not r.busy and usage >= p.kv_busy_threshold:
            r.busy = True
        # A request whose prefix is cached here is warm: it adds little prefill and few new blocks,
        # and the checks below (predicted TPOT, the KV it still needs) look at what it adds. The
        # coarse brakes (the busy mark's hysteresis, the TPOT guard's in-flight limit) would only
        # send it to a cold replica to compute its whole prompt again.
        warm = cached > 0 and r.latency is not None
        if (r.busy and not warm) or len(r.inflight) >= p.max_inflight_per_replica:
            return _Room.NO
        if len(r.inflight) >= r.concurrency_limit and not warm:
            return _Room.NO
        if p.tpot_hold and r.inflight and r.latency is not None:
            # the batch it would join must stay within the strictest TPOT promised there, and
            # while a higher band sends, leave room in it for that band's next requests
            limit = min(min(r.tpot_slos, default=float("inf")), adm.tpot_slo or float("inf")) * p.tpot_guard_margin
            if protected_tpot < float("inf"):
                limit = min(limit, protected_tpot * p.tpot_guard_margin * (1 - p.tpot_reserve_fraction))
            if limit < float("inf") and r.predict_tpot(adm, now) > limit:  # type: ignore[operator]
                return _Room.NO
        if r.latency is not None and p.ttft_reserve_fraction > 0:
            # keep the prefill queue short enough for a higher band's next request to start in time
            uncached = adm.info.prompt_tokens - cached
            pairs = r.queued_prefill_pairs + prefill_pairs(adm.info.prompt_tokens, uncached)
            if protected_ttft < float("inf") and r.latency.ttft(r.queued_prefill_tokens + uncached, 1, r.decoding,
                                                                r.decode_context, pairs) \
                    > protected_ttft * p.ttft_reserve_fraction:
                return _Room.NO
        # the blocks it still needs: its cached prefix is in the pool already (counted in usage
        # while others use it; where it sits evictable, this underestimates, and the engine may
        # have to preempt: measured, rarely)
        cap = r.capacity_blocks
        need = num_blocks(adm.info.prompt_tokens - cached + adm.expected_output, r.block_size) / cap if cap else 0.0
        if r.inflight and usage + need > p.kv_busy_threshold:
            return _Room.LATER
        # its prefill queue is full (what it holds cached adds no prefill work there). Sheddable
        # work queued there does not make others wait: it was let in to use spare capacity, and a
        # request held behind it would still wait for that prefill, then often be refused as late
        # (in rogue-tenant: the SLA tenant's long prompts, behind the free tier's, at load 0.5).
        uncached = adm.info.prompt_tokens - cached
        if r.queued_prefill_tokens and r.queued_prefill_tokens + uncached > p.prefill_busy_tokens \
                and (adm.priority < 0 or r.unstarted_at_or_above(0)):
            return _Room.LATER
        return _Room.YES

    @staticmethod
    def _note_band_slo(slos: dict[int, tuple[float, float]], band: int, slo: float, now: float) -> None:
        prev = slos.get(band)
        recent = prev is not None and now - prev[1] <= BAND_ACTIVE_S
        slos[band] = (min(prev[0], slo) if recent else slo, now)

    @staticmethod
    def _protected(slos: dict[int, tuple[float, float]], priority: int, now: float) -> float:
        """The strictest SLO (in `slos`: the model's TTFT or TPOT SLOs by band) of bands above
        `priority` that sent requests recently."""
        return min((slo for band, (slo, seen) in slos.items()
                    if band > priority and now - seen <= BAND_ACTIVE_S), default=float("inf"))

    def _within_kv_share(self, ms: _ModelState, adm: Admission, now: float, fresh: dict[str, bool]) -> bool:
        """Tenants' KV shares reserve part of the pool; what a tenant does not use is lent out,
        but a borrower may not take the part other tenants have reserved and not yet used."""
        shares = [(name, s.cfg.kv_share) for name, s in self.tenants.items() if s.cfg.kv_share > 0]
        if not shares:
            return True
        caps = [r.capacity_blocks for r in ms.replicas.values() if self._usable(r, fresh)]
        if not caps or not all(caps):
            return True
        pool = sum(caps)
        used = sum(r.inflight_blocks for r in ms.replicas.values())
        reserved_idle = sum(max(0.0, share * pool - self.tenants[name].inflight_blocks)
                            for name, share in shares if name != adm.tenant)
        need = num_blocks(adm.info.prompt_tokens + adm.expected_output, ms.cfg.block_size)
        return used + need <= pool * self.policy.kv_busy_threshold - reserved_idle or used == 0

    # -- fleet signals -----------------------------------------------------------------------------
    def _freshness(self, ms: _ModelState, now: float) -> dict[str, bool]:
        staleness = self.policy.telemetry.staleness_s
        return {name: not r.is_stale(now, staleness) for name, r in ms.replicas.items()}

    def _usable(self, r: ReplicaState, fresh: dict[str, bool]) -> bool:
        if r.removed or not r.healthy:
            return False
        return fresh[r.name] or self.policy.telemetry.on_stale == "fail-open"

    def _saturation(self, ms: _ModelState, now: float, fresh: dict[str, bool]) -> float:
        """llm-d's utilization detector: per replica max(queue / queue threshold, KV / KV
        threshold), averaged over the pool. A stale replica counts as fully saturated when
        failing closed, and by our own accounting alone when failing open; an unhealthy one
        (failed scrape) is saturated. >= 1.0 means saturated."""
        s = self.policy.saturation
        values = []
        for r in ms.replicas.values():
            if r.removed:
                continue
            is_fresh = r.healthy and fresh[r.name]
            if not is_fresh and (not r.healthy or self.policy.telemetry.on_stale == "fail-closed"):
                values.append(1.0)
                continue
            values.append(max(r.queue_depth(is_fresh) / s.queue_depth_threshold,
                              self._usage(r, now, is_fresh) / s.kv_threshold))
        return sum(values) / len(values) if values else 1.0

    def _pool_usage(self, ms: _ModelState, now: float, fresh: dict[str, bool]) -> float:
        usages = [self._usage(r, now, fresh[r.name]) for r in ms.replicas.values() if self._usable(r, fresh)]
        return sum(usages) / len(usages) if usages else 1.0

    def _usage(self, r: ReplicaState, now: float, fresh: bool) -> float:
        p = self.policy
        return r.projected_usage(now, fresh, reserve=p.kv_reservation == "reserve",
                                 project=p.project_recent_dispatches)

    def _ceiling(self, priority: int) -> float:
        p = self.policy
        if priority in p.band_ceilings:
            return p.band_ceilings[priority]
        if priority < 0:
            return p.sheddable_ceiling
        return p.priority_ceiling if priority > 0 else p.default_ceiling

    def _expected_output(self, tenant: _TenantState, model: str, max_tokens: int) -> int:
        if self.policy.kv_reservation == "reserve":
            return max_tokens
        m = tenant.output_models.get(model)
        return m.expected(max_tokens) if m else min(max_tokens, self.policy.expected_output_default)

    # -- refusals ---------------------------------------------------------------------------------
    def estimated_wait(self, ms: _ModelState, priority: int, now: float, tenant: str | None = None) -> float | None:
        """How long a new request of this priority would wait to start, over the rate the model's
        replicas have been completing requests (None until there is a rate): what Retry-After
        says. Ahead of it: the gateway's backlog (`_ahead`), and what was dispatched but has not
        started in its band and above (lower bands go after it)."""
        self._trim_completions(ms, now)
        if len(ms.completions) < MIN_COMPLETIONS_FOR_RATE:
            return None
        rate = len(ms.completions) / max(1.0, now - ms.completions[0])
        ahead = self._ahead(ms, priority, tenant) + sum(r.unstarted_at_or_above(priority)
                                                         for r in ms.replicas.values())
        return ahead / rate

    def queue_wait(self, ms: _ModelState, priority: int, now: float, tenant: str) -> float | None:
        """How long a newcomer would wait in the gateway's queue before its dispatch: the
        backlog ahead of it over the rate the queue has been dispatching.

        Not corrected online, unlike TTFT and TPOT, on purpose: under sustained overload some of
        that backlog expires instead of being served, so observed waits run shorter than this
        (median 0.87x in `surge` at load 2). Learning that admits more requests, more of which
        then expire after waiting out their budget, instead of being refused at once: measured,
        goodput in `surge` at load 3 fell from 41.4 to 34.7 req/s."""
        rate = ms.flow.dispatch_rate(now)
        return None if rate is None else self._ahead(ms, priority, tenant) / rate

    def turnover_wait(self, ms: _ModelState, priority: int, now: float, tenant: str | None) -> float | None:
        """How long until the backlog ahead of a newcomer has left the waiting room, by any way
        (dispatched, expired, refused as late, evicted, cancelled): when a request sent again
        would reach the head. Shorter than `queue_wait` under overload, where much of the
        backlog leaves without being served."""
        rate = ms.flow.departure_rate(now)
        return None if rate is None else self._ahead(ms, priority, tenant) / rate

    @staticmethod
    def _ahead(ms: _ModelState, priority: int, tenant: str | None) -> float:
        """Queued requests a newcomer waits behind: all of the higher bands, and in its own band
        its tenant's queue, which under fair queueing drains at the tenant's weighted share of
        the band (so a tenant flooding its band waits long while a light one does not)."""
        ahead: float = ms.flow.count_ahead(priority + 1)
        band = ms.flow.bands.get(priority)
        if band is not None and band.count:
            q = band.queues.get(tenant) if tenant is not None else None
            if q is None or not q.count:
                ahead += band.count
            else:
                active = sum(other.weight for other in band.queues.values() if other.count)
                ahead += q.count * active / q.weight
        return ahead

    def retry_after(self, ms: _ModelState, priority: int, now: float, tenant: str | None = None) -> float:
        """When a request of this priority and tenant, sent again, would be let through: once
        the backlog ahead of it has left the waiting room (`turnover_wait`), else over the rate
        the fleet completes requests, else a second or so while there is no rate yet. Checked
        against what happened in the simulator: `bench run` reports, per refusal reason, the
        ratio of this to the time until a request of the tenant sent after it got in."""
        wait = self.turnover_wait(ms, priority, now, tenant) if tenant is not None else None
        if wait is None:
            wait = self.estimated_wait(ms, priority, now, tenant)
        if wait is None:
            wait = RETRY_AFTER_MIN_S + len(ms.flow) * 0.05
        return min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, wait))

    @staticmethod
    def _trim_completions(ms: _ModelState, now: float) -> None:
        window_start = now - SERVICE_RATE_WINDOW_S
        while ms.completions and ms.completions[0] < window_start:
            ms.completions.popleft()

    def _refuse(self, request_id: str, tenant: str, priority: int | None, layer: Layer, reason: str,
                message: str, retry_after: float | None = None, param: str | None = None,
                terminal: Terminal = Terminal.REFUSED, retryable: bool | None = None) -> Reject:
        refusal = Refusal(layer, reason, message, retry_after, param, retryable)
        self.stats.outcomes[terminal] += 1
        self.stats.decisions[(terminal.value, layer.value, reason, tenant, priority)] += 1
        return Reject(request_id, refusal, terminal, tenant, priority)

    def record_refusal(self, request_id: str, refusal: Refusal, tenant: str = UNKNOWN_TENANT) -> Reject:
        """Count a refusal the shell made before the core could see the request (a body too
        large or not JSON), so every offered request is accounted in one place."""
        self.stats.offered += 1
        return self._refuse(request_id, tenant, None, refusal.layer, refusal.reason, refusal.message,
                            refusal.retry_after, refusal.param)

    # -- introspection -----------------------------------------------------------------------------
    @staticmethod
    def _prefix_snapshot(r: ReplicaState, now: float) -> dict:
        p = r.prefix
        out = {"mode": "precise" if p.events_live(now) else "approximate", "approx_blocks": len(p.approx)}
        if p.precise is not None:
            out.update(precise_blocks=len(p.precise), kv_events=p.precise.events, unplaced_blocks=p.precise.unplaced)
        return out

    @property
    def queued(self) -> int:
        return sum(len(ms.flow) for ms in self.models.values())

    def snapshot(self, now: float) -> dict:
        out = {"inflight": len(self.inflight), "queued": self.queued, "permits_reclaimed": self.stats.reclaimed,
               "models": {},
               "retries_remembered": None if self._retries is None else len(self._retries)}
        for name, ms in self.models.items():
            fresh = self._freshness(ms, now)
            out["models"][name] = {
                "draining": ms.draining,
                "agents": None if ms.agents is None else {"window": ms.agents.window, "active": len(ms.agents.active)},
                "saturation": round(self._saturation(ms, now, fresh), 4),
                "queued": len(ms.flow),
                "bands": {b.priority: {"queued": b.count, "tenants": {q.tenant: q.count for q in b.queues.values()
                                                                       if q.count}}
                          for b in ms.flow.bands_desc()},
                "replicas": {
                    r.name: {"url": r.url, "healthy": r.healthy, "fresh": fresh[r.name], "busy": r.busy,
                             "removed": r.removed, "inflight": len(r.inflight),
                             "inflight_unseen_by_engine": r.unseen_by_engine, "inflight_drift": r.drift_reported,
                             "capacity_blocks": r.capacity_blocks,
                             "projected_kv_usage": round(r.projected_usage(now, fresh[r.name]), 4),
                             "telemetry_age_s": None if r.telemetry is None else round(r.telemetry_age(now), 3),
                             "prefix_index": self._prefix_snapshot(r, now),
                             "latency": None if r.latency is None else {
                                 "ttft_factor": round(r.latency.ttft_factor, 3),
                                 "tpot_factor": round(r.latency.tpot_factor, 3)}}
                    for r in ms.replicas.values()},
            }
        return out
