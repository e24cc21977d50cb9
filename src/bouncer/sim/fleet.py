"""A fleet in virtual time: clients, a gateway policy, and N engine models.

A discrete-event loop drives three kinds of actor with one clock:
- clients, which send requests, time out, give up, and retry with exponential backoff and jitter,
  honouring Retry-After (so retry storms appear where they would);
- a gateway policy (Bouncer's admission core, or a baseline) that admits, holds or refuses;
- engine models (`bouncer.sim.engine`), each stepping on its own, scraped every
  `scrape_interval_s` with the sample delivered `telemetry_delay_s` later (stale views are the
  normal case); with `kv_events`, each step's prefix-cache changes are published to the gateway
  `kv_events_delay_s` after the step, as vLLM's ZMQ publisher does.

A disaggregated fleet (`FleetConfig.decode_replicas`) splits the engines into prefill and
decode workers, as vLLM's and llm-d's P/D deployments do: the gateway picks one of each; the
prefill worker computes the prompt and its first token (the request runs there with max_tokens 1,
as vLLM's P/D proxy sends it); its KV then crosses the link (`EngineProfile.kv_transfer_s`) to the
decode worker, which takes it as computed and generates the answer. The client's first token is
the decode worker's. Simplification, stated: the decode worker allocates the request's blocks when
the KV has arrived, where vLLM's allocates them before it pulls the KV (a transfer's worth of time
earlier: milliseconds, against decode times of seconds).

Every logical request ends in exactly one outcome (completed, refused, expired, abandoned,
failed); `FleetResult.lost` counts any that did not, and must be 0.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from bouncer.core.fleet.cache_salt import salt_root, salted
from bouncer.core.fleet.replica import Telemetry
from bouncer.sim.engine import EngineModel, EngineRequest, QueueFull, RequestTooLong
from bouncer.sim.profiles import EngineProfile

RETRYABLE = frozenset({429, 503, 504, 529})


@dataclass(slots=True)
class SimRequest:
    """One logical request of a client; it may take several attempts."""

    rid: str
    tenant: str
    priority: int
    arrival: float  # of the first attempt: latency is what the user sees, retries included
    prompt_len: int
    output_len: int  # what the engine will generate (the trace's length, capped by max_tokens)
    max_tokens: int
    block_digests: list[int]
    ttft_slo: float | None
    tpot_slo: float | None
    timeout_s: float  # per attempt
    max_retries: int
    session: str | None = None
    decode_replica: str | None = None  # disaggregated: where the answer is generated
    stage: str = ""  # disaggregated: "prefill", "transfer" or "decode" while at the engines
    parent_session: str | None = None  # a subagent's step: the session that launched it
    cache_salt: str | None = None  # the gateway's for its current attempt (`Dispatched.cache_salt`)
    # progress
    attempt: int = 0
    attempt_id: str = ""
    attempt_at: float = 0.0  # when the current attempt was sent
    replica: str | None = None
    engine_req: EngineRequest | None = None
    reached_engine: bool = False  # some attempt was queued at an engine
    first_token_at: float | None = None
    finished_at: float | None = None
    outcome: str | None = None
    reason: str | None = None
    wasted_tokens: int = 0  # computed for attempts that were abandoned


@dataclass(slots=True)
class Dispatched:
    attempt_id: str
    replica: str  # in a disaggregated fleet, the prefill worker
    decode_replica: str | None = None  # the decode worker, in a disaggregated fleet
    cache_salt: str | None = None  # the `cache_salt` the gateway sets: the engine keys its prefix cache by it


@dataclass(slots=True)
class Refused:
    attempt_id: str
    status: int
    reason: str  # "<layer>/<reason>"
    retry_after: float | None
    final: bool = False  # expired in the gateway queue (TTL): the attempt is over
    should_retry: bool = True  # False: the gateway said `x-should-retry: false`, which openai-python honours


PolicyEvent = Dispatched | Refused


class GatewayPolicy(Protocol):
    """What the simulator drives: Bouncer's core through an adapter, or a baseline."""

    name: str

    def offer(self, req: SimRequest, now: float) -> list[PolicyEvent]: ...
    def tick(self, now: float) -> list[PolicyEvent]: ...
    def next_wakeup(self) -> float | None: ...
    def started(self, attempt_id: str, now: float) -> None: ...
    def handed_over(self, attempt_id: str, now: float) -> list[PolicyEvent]: ...  # disaggregated: prefill done
    def finished(self, attempt_id: str, now: float, completed: bool, completion_tokens: int) -> list[PolicyEvent]: ...
    def cancel(self, attempt_id: str, now: float) -> list[PolicyEvent]: ...
    def engine_refused(self, attempt_id: str, now: float) -> list[PolicyEvent]: ...
    def observe(self, replica: str, telemetry: Telemetry, now: float) -> list[PolicyEvent]: ...
    def kv_events(self, replica: str, stored: list[tuple[str, int]], removed: list[tuple[str, int]],
                  now: float) -> None: ...
    def set_replicas(self, names: list[str], now: float) -> list[PolicyEvent]: ...  # replicas come and go


@dataclass
class FleetConfig:
    replicas: int
    profile: EngineProfile
    kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_queued_reqs: int | None = None  # engine-side caps (the vllm-queue-cap baseline)
    max_num_queued_tokens: int | None = None
    scheduling_policy: str = "fcfs"
    scrape_interval_s: float = 0.25
    telemetry_delay_s: float = 0.05
    kv_events: bool = False  # engines publish prefix-cache events (vLLM --kv-events-config)
    cpu_offload_gib: float = 0.0  # host-memory KV tier per engine (vLLM --kv-offloading-size)
    kv_events_delay_s: float = 0.01
    # disaggregated: this many more engines are decode workers, and the `replicas` are prefill
    # workers (0: every engine serves both, colocated)
    decode_replicas: int = 0
    retry_base_s: float = 0.5  # openai-python's initial backoff
    retry_max_s: float = 8.0
    seed: int = 0

    def roles(self) -> dict[str, str]:
        """Engine name -> role: `both` colocated; `prefill` and `decode` when disaggregated."""
        if not self.decode_replicas:
            return {f"r{i}": "both" for i in range(self.replicas)}
        return {**{f"p{i}": "prefill" for i in range(self.replicas)},
                **{f"d{i}": "decode" for i in range(self.decode_replicas)}}


@dataclass
class FleetResult:
    requests: list[SimRequest]
    sim_seconds: float
    wall_seconds: float
    refused_by_reason: Counter
    attempts: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int  # in any tier (GPU, or loaded back from CPU offloading)
    recomputed_tokens: int
    samples: list[dict] = field(default_factory=list)  # queue depth / KV usage over time
    # what Retry-After told clients, to check it against what happened: (time, tenant, reason,
    # retry_after) per refusal that carried one, and per tenant (attempt sent, admitted) of every
    # admission
    retry_afters: list[tuple[float, str, str, float]] = field(default_factory=list)
    admissions: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # disaggregated: attempts a decode worker refused after their prefill had run (wasted prefill)
    refused_after_prefill: int = 0
    decode_replicas: int = 0  # of the engines, those that decode (disaggregated)

    @property
    def outcomes(self) -> Counter:
        return Counter(r.outcome for r in self.requests)

    @property
    def lost(self) -> int:
        return sum(1 for r in self.requests if r.outcome is None)


# event kinds, ordered so simultaneous events resolve deterministically
_ARRIVE, _STEP, _TELEMETRY, _SCRAPE, _TICK, _TIMEOUT, _SAMPLE, _KV, _RECORD, _HANDOFF = range(10)


class FleetSim:
    def __init__(self, cfg: FleetConfig, policy: GatewayPolicy, replica_names: list[str]) -> None:
        self.cfg = cfg
        self.policy = policy
        self.roles = cfg.roles()
        if sorted(self.roles) != sorted(replica_names):
            raise ValueError(f"the policy's replicas {replica_names} are not the fleet's {list(self.roles)}")
        self.rng = random.Random(cfg.seed)
        # prefix-cache changes of the step in progress, per engine: (stored, removed) (medium, digest)
        self._kv_pending: dict[str, tuple[list, list]] = {name: ([], []) for name in replica_names}
        self.engines: dict[str, EngineModel] = {name: self._new_engine(name) for name in replica_names}
        # engines taken out of the fleet (`retire`): finishing what they hold, then gone
        self.retiring: set[str] = set()
        self.retired: dict[str, EngineModel] = {}
        self._busy_until: dict[str, float | None] = dict.fromkeys(replica_names)
        self._heap: list[tuple] = []
        self._seq = itertools.count()
        self._by_attempt: dict[str, SimRequest] = {}
        self._tick_at = math.inf
        self.refused_by_reason: Counter = Counter()
        self.retry_afters: list[tuple[float, str, str, float]] = []
        self.admissions: dict[str, list[tuple[float, float]]] = {}
        self.attempts = 0
        self.refused_after_prefill = 0
        self.samples: list[dict] = []
        self._open = 0  # requests without an outcome yet
        self._on_done = None  # closed-loop hook: called when a request gets its outcome
        self._sample_until = 0.0
        self._sample_every = 1.0
        self._on_record = None  # the flight recorder's hook (`record`)
        self._record_every = 0.0

    def _new_engine(self, name: str) -> EngineModel:
        cfg = self.cfg
        offload = cfg.profile.offload_blocks(cfg.cpu_offload_gib) if cfg.cpu_offload_gib else 0
        return EngineModel(cfg.profile, num_blocks=cfg.kv_blocks, max_num_seqs=cfg.max_num_seqs,
                           policy=cfg.scheduling_policy, max_num_queued_reqs=cfg.max_num_queued_reqs,
                           max_num_queued_tokens=cfg.max_num_queued_tokens,
                           kv_event_sink=self._kv_sink(name) if cfg.kv_events else None, cpu_offload_blocks=offload)

    # -- engines that come and go (`bouncer.sim.provisioner`) -----------------------------------
    def add_engine(self, name: str, now: float) -> None:
        """A new replica (colocated) is ready: scraped from now on, and the gateway told."""
        if name in self.engines or name in self.retired:
            raise ValueError(f"engine {name} exists already")
        self.roles[name] = "both"
        self._kv_pending[name] = ([], [])
        self.engines[name] = self._new_engine(name)
        self._busy_until[name] = None
        self._apply(self.policy.set_replicas(self.serving(), now), now)
        self._scrape(name, now)

    def retire(self, name: str, now: float) -> None:
        """Take a replica out: the gateway sends it nothing new; it finishes what it holds (a
        pod's graceful stop) and is gone once empty."""
        self.retiring.add(name)
        self._apply(self.policy.set_replicas(self.serving(), now), now)
        self._maybe_gone(name)

    def serving(self) -> list[str]:
        """The replicas the gateway may send to."""
        return [n for n in self.engines if n not in self.retiring]

    def _maybe_gone(self, name: str) -> None:
        e = self.engines.get(name)
        if name in self.retiring and e is not None and not e.num_running and not e.num_waiting \
                and self._busy_until[name] is None:
            self.retired[name] = self.engines.pop(name)
            self.retiring.discard(name)

    def record(self, every_s: float, on_record) -> None:
        """Call `on_record(now)` every `every_s` of simulated time from the start until the last
        request has its outcome (the flight recorder's samples, `bouncer bench run --record`)."""
        self._on_record, self._record_every = on_record, every_s

    def _kv_sink(self, name: str):
        stored, removed = self._kv_pending[name]

        media = {"stored": (stored, "GPU"), "removed": (removed, "GPU"), "offloaded": (stored, "CPU"),
                 "dropped": (removed, "CPU")}

        def sink(kind: str, digests: list[int]) -> None:
            out, medium = media[kind]
            out.extend((medium, d) for d in digests)
        return sink

    # -- the event queue -------------------------------------------------------------------------
    def _push(self, t: float, kind: int, data) -> None:
        heapq.heappush(self._heap, (t, kind, next(self._seq), data))

    def run(self, requests: list[SimRequest], sample_every_s: float = 1.0) -> FleetResult:
        """Replay `requests` (open loop) until every one has an outcome."""
        wall0 = time.perf_counter()
        for req in requests:
            self._push(req.arrival, _ARRIVE, req)
        self._open = len(requests)
        self._start_scrapes()
        self._sample_until = max((r.arrival for r in requests), default=0.0)
        self._sample_every = sample_every_s
        self._push(0.0, _SAMPLE, None)
        now = self._loop(math.inf)
        engines = {**self.retired, **self.engines}
        counters = [e.counters for e in engines.values()]
        # prefix caching is the prompt computers' (a decode worker receives whole prompts)
        prefilling = [e.counters for name, e in engines.items() if self.roles[name] != "decode"]
        return FleetResult(requests, now, time.perf_counter() - wall0, self.refused_by_reason, self.attempts,
                           sum(c.num_preemptions for c in counters), sum(c.prefix_cache_queries for c in prefilling),
                           sum(c.prefix_cache_hits + c.external_prefix_cache_hits for c in prefilling),
                           sum(c.recomputed_tokens for c in counters),
                           self.samples, self.retry_afters, self.admissions, self.refused_after_prefill,
                           self.cfg.decode_replicas)

    def run_closed_loop(self, make_request, clients: int, warmup_s: float, measure_s: float) -> float:
        """`clients` loops of send, wait for the outcome, send again; `make_request(rid, now)`
        builds each request. Returns completions per second over the measurement window."""
        end = warmup_s + measure_s
        completed = 0
        ids = itertools.count()

        def on_done(req: SimRequest, now: float) -> None:
            nonlocal completed
            if req.outcome == "completed" and warmup_s <= now < end:
                completed += 1
            if now < end:
                self._open += 1
                self._push(now, _ARRIVE, make_request(f"c{next(ids)}", now))

        self._on_done = on_done
        self._open = 0
        for i in range(clients):
            self._open += 1
            self._push(i * 1e-3, _ARRIVE, make_request(f"c{next(ids)}", i * 1e-3))
        self._start_scrapes()
        self._loop(end)
        return completed / measure_s

    def run_sessions(self, first: list[SimRequest], follow, until: float) -> float:
        """Closed loop of agent sessions: the `first` requests go at once (1 ms apart); when a
        request gets its outcome, `follow(req, now)` returns the (delay, request) pairs it leads
        to (its session's next step, a subagent's first, a new session's first when its session
        ended). Stops at `until`; returns the simulated time reached."""
        def on_done(req: SimRequest, now: float) -> None:
            if now >= until:
                return
            for delay, new in follow(req, now):
                self._open += 1
                self._push(now + delay, _ARRIVE, new)

        self._on_done = on_done
        self._open = 0
        for i, req in enumerate(first):
            self._open += 1
            self._push(i * 1e-3, _ARRIVE, req)
        self._start_scrapes()
        self._sample_until = until
        self._push(0.0, _SAMPLE, None)
        return self._loop(until)

    def _start_scrapes(self) -> None:
        """The gateway has scraped every (idle) replica once before traffic starts, as a
        deployed gateway would have; later scrapes are staggered, as independent scrapers are."""
        for i, name in enumerate(self.engines):
            self.policy.observe(name, self._telemetry(name, 0.0), 0.0)
            self._push((i + 1) * self.cfg.scrape_interval_s / len(self.engines), _SCRAPE, name)
        if self._on_record is not None:
            self._push(0.0, _RECORD, None)

    def _loop(self, until: float) -> float:
        now = 0.0
        while self._heap and self._open:
            if self._heap[0][0] > until:
                break
            now, kind, _, data = heapq.heappop(self._heap)
            if kind == _ARRIVE:
                self._attempt(data, now)
            elif kind == _STEP:
                self._step_end(data, now)
            elif kind == _TELEMETRY:
                name, sample = data
                if name in self.engines:
                    self._apply(self.policy.observe(name, sample, now), now)
            elif kind == _SCRAPE:
                self._scrape(data, now)
            elif kind == _TICK:
                if now >= self._tick_at:
                    self._tick_at = math.inf
                    self._apply(self.policy.tick(now), now)
            elif kind == _TIMEOUT:
                self._timeout(data, now)
            elif kind == _SAMPLE:
                self._sample(now)
                if now < self._sample_until:
                    self._push(now + self._sample_every, _SAMPLE, None)
            elif kind == _KV:
                name, stored, removed = data
                self.policy.kv_events(name, stored, removed, now)
            elif kind == _RECORD:
                self._on_record(now)
                self._push(now + self._record_every, _RECORD, None)
            elif kind == _HANDOFF:
                self._handoff(data, now)
            self._schedule_tick(now)
        if self._on_record is not None:
            self._on_record(now)  # the last sample: what happened after the one before
        return now

    def _schedule_tick(self, now: float) -> None:
        wake = self.policy.next_wakeup()
        if wake is not None and wake < self._tick_at:
            self._tick_at = max(wake, now)
            self._push(self._tick_at, _TICK, None)

    # -- clients ----------------------------------------------------------------------------------
    def _attempt(self, req: SimRequest, now: float) -> None:
        if req.outcome is not None:
            return
        req.attempt += 1
        req.attempt_id = f"{req.rid}#{req.attempt}"
        req.attempt_at = now
        req.replica = None
        req.decode_replica = None
        req.stage = ""
        req.engine_req = None
        self._by_attempt[req.attempt_id] = req
        self.attempts += 1
        self._push(now + req.timeout_s, _TIMEOUT, req.attempt_id)
        self._apply(self.policy.offer(req, now), now)

    def _retry_or_end(self, req: SimRequest, now: float, outcome: str, reason: str,
                      retry_after: float | None, retryable: bool) -> None:
        """The attempt failed: retry like a real client would, or give up with `outcome`."""
        self._by_attempt.pop(req.attempt_id, None)
        req.attempt_id = ""
        if retryable and req.attempt <= req.max_retries:
            backoff = min(self.cfg.retry_max_s, self.cfg.retry_base_s * 2 ** (req.attempt - 1))
            backoff *= 1 - 0.25 * self.rng.random()  # jitter, as openai-python
            delay = retry_after if retry_after is not None else backoff
            self._push(now + delay, _ARRIVE, req)
            return
        req.outcome = outcome
        req.reason = reason
        req.finished_at = now
        self._open -= 1
        if self._on_done is not None:
            self._on_done(req, now)

    def _timeout(self, attempt_id: str, now: float) -> None:
        req = self._by_attempt.get(attempt_id)
        if req is None or req.attempt_id != attempt_id:
            return  # that attempt already ended
        if req.replica is None:  # still queued at the gateway
            events = self.policy.cancel(attempt_id, now)
        elif req.stage == "transfer":  # its KV is on the wire: the prefill's work is lost
            req.wasted_tokens += req.prompt_len
            events = self.policy.finished(attempt_id, now, False, 0)
        else:
            engine = self.engines[req.replica]
            ereq = engine.abort(attempt_id, now)
            if ereq is not None:
                req.wasted_tokens += ereq.max_computed
            events = self.policy.finished(attempt_id, now, False, ereq.num_output if ereq else 0)
        self._retry_or_end(req, now, "abandoned", "client_timeout", None, retryable=True)
        self._apply(events, now)

    # -- gateway decisions ------------------------------------------------------------------------
    def _apply(self, events: list[PolicyEvent], now: float) -> None:
        for ev in events:
            req = self._by_attempt.get(ev.attempt_id)
            if req is None:
                continue
            if isinstance(ev, Dispatched):
                self.admissions.setdefault(req.tenant, []).append((req.attempt_at, now))
                req.cache_salt = ev.cache_salt
                self._send(req, ev.replica, now, ev.decode_replica)
            else:
                self.refused_by_reason[ev.reason] += 1
                if ev.retry_after is not None:
                    self.retry_afters.append((now, req.tenant, ev.reason, ev.retry_after))
                outcome = "expired" if ev.reason.endswith("ttl_expired") else "refused"
                self._retry_or_end(req, now, outcome, ev.reason, ev.retry_after,
                                   ev.status in RETRYABLE and ev.should_retry)

    def _send(self, req: SimRequest, replica: str, now: float, decode_replica: str | None = None,
              remote_tokens: int = 0) -> None:
        """To `replica`; in a disaggregated fleet, to the prefill worker `replica` with the decode
        worker named, or (`remote_tokens`, its KV arrived) to the decode worker."""
        role = self.roles[replica]
        if (role == "prefill") != (decode_replica is not None) or (role == "decode") != (remote_tokens > 0):
            raise ValueError(f"attempt {req.attempt_id} sent to {role} engine {replica} "
                             f"(decode worker {decode_replica}, {remote_tokens} tokens of KV handed over)")
        engine = self.engines[replica]
        # a prefill worker computes the prompt and one token, as vLLM's P/D proxy asks it to
        output = 1 if role == "prefill" else req.output_len
        # the engine keys its prefix cache by the request's cache salt, where the gateway sets one (vLLM)
        digests = salted(req.block_digests, salt_root(req.cache_salt)) if req.cache_salt else req.block_digests
        ereq = EngineRequest(req.attempt_id, req.prompt_len, output, digests, now,
                             priority=-req.priority, remote_tokens=remote_tokens)  # vLLM: lower value first
        try:
            engine.add_request(ereq)
        except QueueFull as exc:
            self.refused_by_reason[f"engine/{exc.reason}"] += 1
            if remote_tokens:
                self.refused_after_prefill += 1
                req.wasted_tokens += req.prompt_len
            self._apply(self.policy.engine_refused(req.attempt_id, now), now)
            return
        except RequestTooLong:
            self.refused_by_reason["engine/too_long"] += 1
            self._apply(self.policy.finished(req.attempt_id, now, False, 0), now)
            self._retry_or_end(req, now, "failed", "engine/too_long", None, retryable=False)
            return
        req.replica = replica
        if role != "both":
            req.stage = role
            req.decode_replica = decode_replica if role == "prefill" else replica
        req.engine_req = ereq
        req.reached_engine = True
        if self._busy_until[replica] is None:
            self._start_step(replica, now)

    # -- engines ----------------------------------------------------------------------------------
    def _start_step(self, name: str, now: float) -> None:
        engine = self.engines[name]
        horizon = self._heap[0][0] if self._heap else None
        result = engine.step(now, horizon)
        if result is None:
            self._busy_until[name] = None
            return
        self._busy_until[name] = result.end
        self._push(result.end, _STEP, (name, result))

    def _handoff(self, attempt_id: str, now: float) -> None:
        """Its prompt's KV has reached its decode worker."""
        req = self._by_attempt.get(attempt_id)
        if req is None or req.stage != "transfer":
            return  # that attempt already ended
        self._send(req, req.decode_replica, now, remote_tokens=req.prompt_len)  # type: ignore[arg-type]

    def _prefilled(self, ereq: EngineRequest, now: float) -> None:
        """A prefill worker is done with an attempt: its KV goes to the decode worker."""
        req = self._by_attempt.get(ereq.request_id)
        if req is None:
            return
        req.stage = "transfer"
        self._push(now + self.cfg.profile.kv_transfer_s(req.prompt_len), _HANDOFF, ereq.request_id)
        self._apply(self.policy.handed_over(ereq.request_id, now), now)

    def _step_end(self, data, now: float) -> None:
        name, result = data
        events: list[PolicyEvent] = []
        if self.roles[name] == "prefill":  # its first token is not the client's: the decode worker's is
            for ereq in result.finished:
                self._prefilled(ereq, now)
            result.started, result.finished = [], []
        for ereq in result.started:  # (not every token: the batch is hundreds of requests)
            req = self._by_attempt.get(ereq.request_id)
            if req is None:
                continue
            if req.first_token_at is None:
                req.first_token_at = now
            self.policy.started(ereq.request_id, now)
        for ereq in result.finished:
            req = self._by_attempt.pop(ereq.request_id, None)
            if req is None:
                continue
            req.outcome = "completed"
            req.finished_at = now
            req.attempt_id = ""
            self._open -= 1
            events += self.policy.finished(ereq.request_id, now, True, ereq.num_output)
            if self._on_done is not None:
                self._on_done(req, now)
        self._busy_until[name] = None
        stored, removed = self._kv_pending[name]
        if self.retiring:
            self._maybe_gone(name)
        if stored or removed:  # published after the step, as vLLM does
            self._push(now + self.cfg.kv_events_delay_s, _KV, (name, stored[:], removed[:]))
            stored.clear()
            removed.clear()
        if name in self.engines:
            self._start_step(name, now)
        self._apply(events, now)

    def _telemetry(self, name: str, now: float) -> Telemetry:
        e = self.engines[name]
        return Telemetry(at=now, kv_usage=e.kv_usage, running=e.num_running, waiting=e.num_waiting,
                         num_blocks=e.pool.num_blocks, block_size=e.block_size,
                         prefix_queries=e.counters.prefix_cache_queries, prefix_hits=e.counters.prefix_cache_hits,
                         preemptions=e.counters.num_preemptions)

    def _scrape(self, name: str, now: float) -> None:
        if name not in self.engines:
            return  # retired
        self._push(now + self.cfg.telemetry_delay_s, _TELEMETRY, (name, self._telemetry(name, now)))
        self._push(now + self.cfg.scrape_interval_s, _SCRAPE, name)

    def _sample(self, now: float) -> None:
        usage = [e.kv_usage for e in self.engines.values()] or [0.0]
        mean = sum(usage) / len(usage)
        if self.cfg.decode_replicas:
            sample = {}
            for role in ("prefill", "decode"):
                pool = [e.kv_usage for name, e in self.engines.items() if self.roles[name] == role]
                sample[f"{role}_kv_usage_mean"] = sum(pool) / len(pool)
        else:
            sample = {}
        self.samples.append({"t": round(now, 3), "engine_waiting": sum(e.num_waiting for e in self.engines.values()),
                             "running": sum(e.num_running for e in self.engines.values()),
                             "kv_usage_mean": mean, "kv_usage_max": max(usage),
                             "kv_imbalance": max(usage) / mean if mean > 0 else None,
                             # cumulative, all tiers: hit rate over time comes from their deltas
                             "prefix_queries": sum(e.counters.prefix_cache_queries for e in self.engines.values()),
                             "prefix_hits": sum(e.counters.prefix_cache_hits + e.counters.external_prefix_cache_hits
                                                for e in self.engines.values()),
                             "gateway_queued": getattr(self.policy, "queued", 0), **sample})
