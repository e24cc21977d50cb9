"""A sans-IO model of one vLLM v1 engine, advanced in virtual time.

It models what makes an engine run out: paged KV blocks, a prefix cache with LRU eviction,
continuous batching under a per-step token budget with chunked prefill, `max_num_seqs`, and
preemption by recompute. The scheduling loop follows vLLM v1's `Scheduler.schedule()`:

1. Running requests first, in order. Each asks for its next tokens (one when decoding, the rest
   of its prompt when prefilling, capped by the token budget). If the pool cannot give it the
   blocks, the lowest-priority running request (the last one under FCFS; the largest
   (priority, arrival) under the priority policy) is preempted: its blocks are freed, its
   computed tokens forgotten, and it goes back to the front of the waiting queue. Its output so
   far is kept, so on resumption it recomputes prompt + output in one prefill.
2. Waiting requests next, but only in a step that preempted nothing, while the budget and
   `max_num_seqs` allow. A fresh request first reuses the longest cached run of its prompt's
   block digests (at least one token is always computed), then allocates the rest. The first
   waiting request that does not fit stops admission for this step (head-of-line, as vLLM).
3. The step lasts `profile.step_time(batched tokens, context tokens, attention pairs)` (pairs:
   for every request computing more than one token, each new token with itself and every token
   before it). A request whose every known token is computed samples one new token at the end
   of the step; it finishes when it has produced its target length (or hit `max_model_len`).

Nothing here reads a clock or does IO: callers pass `now` and get back when the step ends and
what it produced. The simulator may pass a `horizon` (the next external event): a step that is
pure decode and cannot admit anyone is then extended over as many identical-shape steps as fit
before the horizon, the next finish, or the next block shortage. That gives the same state and
timing as stepping one by one (tested) at a fraction of the cost.

A batch is mostly requests that only decode, and a step gives each of them one token, so the
model keeps them in a decode cohort (`_DecodeCohort`) instead of touching each one every step:
their progress is one shared tick plus a per-request offset, read back on demand; the few that
need a new KV block at a given tick are found by residue bucket, those that finish by a heap, and
the batch's context tokens are a running sum. Only the rest of `running` (normally at most one
request, mid-prefill, at its tail), admissions, block crossings and finishes cost Python work per
step. The cohort leads `running`, so it is scheduled first, as the per-request loop would, and
blocks are handed out in running order. A step in which that loop could treat the cohort
differently (a block shortage would preempt, or a request outside the cohort sits among its
members) first dissolves it and runs request by request; the cohort re-forms from the requests
that decode after that step. Step results and state are the same either way (tested).

Priorities use vLLM's polarity here (lower value served first), because this is a model of vLLM.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from operator import attrgetter

from bouncer.core.fleet.blocks import num_blocks
from bouncer.core.learning.latency import prefill_pairs
from bouncer.sim.kv_pool import KVEventSink, KVPool
from bouncer.sim.profiles import EngineProfile


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


class QueueFull(Exception):
    """vLLM's admission refusal (`max_num_queued_reqs` / `max_num_queued_tokens`): HTTP 503."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RequestTooLong(Exception):
    """The request can never fit this engine (context length or the whole KV pool): HTTP 400."""


@dataclass(slots=True, eq=False)
class EngineRequest:
    request_id: str
    prompt_len: int
    max_output: int
    block_digests: list[int]  # chained digests of the prompt's full blocks
    arrival: float
    priority: int = 0  # vLLM polarity: lower value is served first
    # prompt tokens whose KV a prefill worker computed and handed over (disaggregated serving):
    # a decode engine takes them as computed at admission, as vLLM's NixlConnector does, all but
    # the last token, which it computes to sample the first output token. Gone after preemption:
    # the engine then recomputes the prompt itself.
    remote_tokens: int = 0
    # the answer ends with an end-of-sequence token at max_output, short of the client's
    # max_tokens: finish reason "stop" (vLLM's), not "length", unless max_model_len cuts it first
    ends_at_eos: bool = False
    # progress, vLLM's names (num_computed, num_output and max_computed are properties below)
    blocks: list[int] = field(default_factory=list)
    num_registered: int = 0  # prompt blocks made findable in the prefix cache
    num_cached_tokens: int = 0  # prefix-cache hit at the last (re)admission
    status: Status = Status.WAITING
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    _seq: int = 0  # tie-break for the priority queue
    # Outside the decode cohort these hold the progress; inside it, the cohort's tick does.
    _num_computed: int = field(default=0, init=False, repr=False)
    _num_output: int = field(default=0, init=False, repr=False)
    _max_computed: int = field(default=0, init=False, repr=False)
    _cohort: _DecodeCohort | None = field(default=None, init=False, repr=False)
    _offset: int = field(default=0, init=False, repr=False)  # num_output - cohort tick, in the cohort
    _order: int = field(default=0, init=False, repr=False)  # increases along `running`

    @property
    def num_output(self) -> int:
        cohort = self._cohort
        return self._num_output if cohort is None else cohort.tick + self._offset

    @num_output.setter
    def num_output(self, value: int) -> None:
        self._num_output = value

    @property
    def num_computed(self) -> int:
        cohort = self._cohort
        # a decoding request has computed every token but the one it sampled last
        return self._num_computed if cohort is None else self.prompt_len + cohort.tick + self._offset - 1

    @num_computed.setter
    def num_computed(self, value: int) -> None:
        self._num_computed = value

    @property
    def max_computed(self) -> int:
        """High-water mark of num_computed: what lies below it is recomputation."""
        # in the cohort num_computed grows every step, so it is its own high-water mark
        return self._max_computed if self._cohort is None else self.num_computed

    @max_computed.setter
    def max_computed(self, value: int) -> None:
        self._max_computed = value

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed >= self.prompt_len


@dataclass(slots=True)
class StepResult:
    start: float
    end: float
    num_steps: int  # >1 when a decode-only step was extended
    batched_tokens: int  # of the first step
    finished: list[EngineRequest]
    preempted: list[EngineRequest]
    started: list[EngineRequest]  # whose first token this step produced
    decoders: list[EngineRequest]  # the decode cohort, which produced `num_steps` tokens each
    other_tokens: list[tuple[EngineRequest, int]]  # new output tokens of the other requests

    @property
    def tokens(self) -> list[tuple[EngineRequest, int]]:
        """New output tokens per request, produced at `end`, in batch order. Built on demand:
        the simulator does not need it, and a batch is hundreds of requests."""
        n = self.num_steps
        return [(req, n) for req in self.decoders] + self.other_tokens


@dataclass(slots=True)
class EngineCounters:
    """Monotonic counters, vLLM's metric families (without the `vllm:` prefix)."""

    prompt_tokens: int = 0  # counted once per request, at its first token (as vLLM)
    prompt_tokens_cached: int = 0  # of those, found in the prefix cache
    generation_tokens: int = 0
    recomputed_tokens: int = 0  # KV recomputed after preemption (work done twice)
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    # found in the CPU tier (KV offloading) and loaded instead of recomputed; vLLM counts these
    # as external_prefix_cache_hits (vllm/v1/metrics/loggers.py)
    external_prefix_cache_hits: int = 0
    kv_transfer_tokens: int = 0  # received from prefill workers instead of computed (disaggregated)
    num_preemptions: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: {"length": 0, "stop": 0, "abort": 0})
    admission_rejections: dict[str, int] = field(
        default_factory=lambda: {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0})
    busy_time: float = 0.0  # seconds spent in steps
    steps: int = 0


class _WaitingQueue:
    """FCFS: a deque; preempted requests return to the front. Priority: a heap on
    (priority, arrival) with lazy deletion of aborted entries."""

    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.policy = policy
        self._fifo: deque[EngineRequest] = deque()
        self._heap: list[tuple[int, float, int, EngineRequest]] = []
        self._live = 0

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else self._live

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(self._fifo)
        return (entry[3] for entry in self._heap if entry[3].status in (Status.WAITING, Status.PREEMPTED))

    def push(self, req: EngineRequest, front: bool = False) -> None:
        if self.policy == "fcfs":
            (self._fifo.appendleft if front else self._fifo.append)(req)
        else:
            heapq.heappush(self._heap, (req.priority, req.arrival, req._seq, req))
            self._live += 1

    def peek(self) -> EngineRequest | None:
        if self.policy == "fcfs":
            return self._fifo[0] if self._fifo else None
        heap = self._heap
        while heap and heap[0][3].status not in (Status.WAITING, Status.PREEMPTED):
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def pop(self) -> EngineRequest:
        if self.policy == "fcfs":
            return self._fifo.popleft()
        self.peek()
        self._live -= 1
        return heapq.heappop(self._heap)[3]

    def remove(self, req: EngineRequest) -> None:
        """Called before the request's status leaves WAITING/PREEMPTED."""
        if self.policy == "fcfs":
            self._fifo.remove(req)
        else:
            self._live -= 1  # its heap entry is dropped lazily


_RUNNING_ORDER = attrgetter("_order")


class _DecodeCohort:
    """Running requests that only decode, advanced together: a step that schedules them gives
    each one token, so their progress is the shared `tick` plus a per-request offset.

    What differs per request is found by index, not by a scan: a request needs a new KV block
    in the step that starts at a tick congruent to its `_due` residue (its computed tokens are
    then a multiple of the block size), and it finishes at the tick its finish-heap key names.
    """

    def __init__(self, block_size: int, max_model_len: int) -> None:
        self.tick = 0
        self.size = 0
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._due: list[set[EngineRequest]] = [set() for _ in range(block_size)]  # by tick % block size
        self._finish: list[tuple[int, int, EngineRequest]] = []  # (tick, running order, request)
        self._context_base = 0  # sum of prompt_len + offset: context tokens less size * tick

    def join(self, req: EngineRequest) -> None:
        """Take over a request that has just sampled a token and has nothing left to prefill."""
        offset = req.num_output - self.tick
        req._offset = offset
        req._cohort = self
        self.size += 1
        self._context_base += req.prompt_len + offset
        self._due[self._residue(req)].add(req)
        finish_tick = min(req.max_output, self._max_model_len - req.prompt_len) - offset
        heapq.heappush(self._finish, (finish_tick, req._order, req))

    def leave(self, req: EngineRequest) -> None:
        """Hand a request back to per-request accounting (its finish-heap entry goes stale)."""
        self._due[self._residue(req)].discard(req)
        self._context_base -= req.prompt_len + req._offset
        self.size -= 1
        self._materialize(req)

    def dissolve(self) -> None:
        for bucket in self._due:
            for req in bucket:
                self._materialize(req)
            bucket.clear()
        self._finish.clear()
        self._context_base = 0
        self.size = 0

    def context_tokens(self) -> int:
        """Context tokens of the cohort in the step starting now (computed + the new token)."""
        return self._context_base + self.size * self.tick

    def due(self, tick: int) -> set[EngineRequest]:
        """Members that need one more KV block in the step starting at `tick`."""
        return self._due[tick % self._block_size]

    def blocks_due_by_residue(self) -> list[int]:
        """How many members need a new block in a step starting at a tick, by tick % block size."""
        return [len(bucket) for bucket in self._due]

    def first_finish(self) -> int:
        """The tick at which the next member finishes (at least one member must be left)."""
        heap = self._finish
        while heap[0][2]._cohort is not self:  # left early (aborted)
            heapq.heappop(heap)
        return heap[0][0]

    def pop_finished(self) -> list[EngineRequest]:
        """Members whose output is complete at the current tick, in running order, removed.
        Steps never run past a member's finish, so those due now share one key and the heap
        yields them by running order."""
        heap = self._finish
        done = []
        while heap and (heap[0][0] <= self.tick or heap[0][2]._cohort is not self):
            req = heapq.heappop(heap)[2]
            if req._cohort is self:
                self.leave(req)
                done.append(req)
        return done

    def _residue(self, req: EngineRequest) -> int:
        # computed tokens at tick t are prompt_len + offset + t - 1: a multiple of the block
        # size, so the step needs a new block, when t = 1 - prompt_len - offset (mod block size)
        return (1 - req.prompt_len - req._offset) % self._block_size

    def _materialize(self, req: EngineRequest) -> None:
        num_output = self.tick + req._offset
        req._num_output = num_output
        req._num_computed = req._max_computed = req.prompt_len + num_output - 1
        req._cohort = None


class EngineModel:
    def __init__(self, profile: EngineProfile, *, num_blocks: int | None = None,
                 block_size: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 policy: str = "fcfs", enable_prefix_caching: bool = True,
                 max_num_queued_reqs: int | None = None, max_num_queued_tokens: int | None = None,
                 kv_event_sink: KVEventSink | None = None, cpu_offload_blocks: int = 0) -> None:
        self.profile = profile
        self.block_size = block_size or profile.block_size
        self.pool = KVPool(num_blocks or profile.num_blocks, self.block_size,
                           enable_prefix_caching, kv_event_sink, cpu_offload_blocks)
        self._loaded_tokens = 0  # loaded back from the CPU tier in the step being scheduled
        self.max_num_seqs = max_num_seqs or profile.max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens or profile.max_num_batched_tokens
        self.max_model_len = max_model_len or profile.max_model_len
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.waiting = _WaitingQueue(policy)
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self.counters = EngineCounters()
        self._seq = itertools.count()
        self._order = itertools.count()  # running order: stamped on each request as it is admitted
        # leads `running`: running[:cohort.size] are its members, in running order
        self._cohort = _DecodeCohort(self.block_size, self.max_model_len)

    # -- state seen from outside ------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_usage(self) -> float:
        return self.pool.usage

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of requests not yet through prefill (what `max_num_queued_tokens` caps)."""
        running = sum(r.prompt_len - r.num_computed for r in self.running
                      if r._cohort is None and not r.is_prefill_done)  # the cohort is past prefill
        return running + sum(r.prompt_len - r.num_computed for r in self.waiting)

    # -- requests in and out ----------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if req.prompt_len < 1 or req.max_output < 1:
            raise RequestTooLong("a request needs at least one prompt token and one output token")
        # As vLLM 0.32: only a prompt longer than the context is refused; prompt + max_tokens may
        # exceed it, and generation then stops at max_model_len (finish reason "length").
        if req.prompt_len > self.max_model_len:
            raise RequestTooLong(f"prompt ({req.prompt_len} tokens) exceeds max_model_len {self.max_model_len}")
        # Not vLLM (which sizes max_model_len to fit its pool at start-up): with a pool shrunk by
        # --kv-blocks a request could otherwise wait forever.
        longest = min(req.prompt_len + req.max_output, self.max_model_len)
        if num_blocks(longest, self.block_size) > self.pool.num_blocks:
            raise RequestTooLong(f"request needs more KV blocks than the pool has ({self.pool.num_blocks})")
        # vLLM checks the request cap first; both count running + waiting requests.
        if self.max_num_queued_reqs is not None and \
                len(self.running) + len(self.waiting) >= self.max_num_queued_reqs:
            self.counters.admission_rejections["max_num_queued_reqs"] += 1
            raise QueueFull("max_num_queued_reqs")
        if self.max_num_queued_tokens is not None and \
                self.queued_prompt_tokens() + req.prompt_len > self.max_num_queued_tokens:
            self.counters.admission_rejections["max_num_queued_tokens"] += 1
            raise QueueFull("max_num_queued_tokens")
        req._seq = next(self._seq)
        req.status = Status.WAITING
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def abort(self, request_id: str, now: float) -> EngineRequest | None:
        """Client went away: free its blocks wherever it is. Unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is Status.RUNNING:
            if req._cohort is not None:
                self._cohort.leave(req)
            self.running.remove(req)
            self.pool.release(req.blocks)
            req.blocks = []
        else:
            self.waiting.remove(req)
        req.status = Status.ABORTED
        req.finished_at = now
        req.finish_reason = "abort"
        self.counters.request_success["abort"] += 1
        return req

    # -- one step -------------------------------------------------------------------------------
    def step(self, now: float, horizon: float | None = None) -> StepResult | None:
        """Schedule and run one step starting at `now`; None when nothing can run.

        State is updated at once; the caller must treat the tokens as produced at `result.end`
        and not call `step` again before then. With a `horizon`, a pure-decode step may be
        extended (see module doc).
        """
        self._loaded_tokens = 0
        cohort = self._cohort
        if cohort.size and not self._cohort_runs_as_is():
            cohort.dissolve()
        decoders = self.running[:cohort.size]
        scheduled, preempted = self._schedule(now)
        if not scheduled and not decoders:
            return None
        batched = len(decoders)
        context = cohort.context_tokens()
        pairs = 0  # attention's compute over prompt chunks: each token with itself and those before
        for req, n in scheduled:
            batched += n
            context += req.num_computed + n
            if n > 1:
                pairs += prefill_pairs(req.num_computed + n, n)
        duration = self.profile.step_time(batched, context, pairs)
        if self._loaded_tokens:
            # vLLM loads offloaded blocks asynchronously; charging the copy to the step that
            # admits the request errs on the slow side
            duration += self._loaded_tokens * self.profile.offload_load_s_per_token
        num_steps = 1
        pure_decode = batched == len(decoders) + len(scheduled) and all(r.num_output > 0 for r, _ in scheduled)
        # A pure-decode step that preempted nobody admitted nobody either: the waiting head is
        # blocked by blocks, seats or budget, and stays blocked until a request finishes.
        if horizon is not None and pure_decode and not preempted:
            extra, extra_time = self._extension(scheduled, now + duration, horizon, batched, context)
            num_steps += extra
            duration += extra_time
        end = now + duration
        self.counters.steps += num_steps
        self.counters.busy_time += duration
        tokens, finished, started = self._apply(scheduled, len(decoders), num_steps, end)
        return StepResult(now, end, num_steps, batched, finished, preempted, started, decoders, tokens)

    def _cohort_runs_as_is(self) -> bool:
        """Whether the per-request loop would give every cohort member its token and preempt
        nobody: the cohort leads `running`, and the blocks it and the requests after it ask
        for this step are free. (The budget cannot bind within the cohort: requests are only
        admitted while budget is left after every running one got a token, so `running` never
        outnumbers the budget.)"""
        size = self._cohort.size
        budget = self.max_num_batched_tokens - size
        rest = self.running[size:]
        if any(req._cohort is not None for req in rest):
            return False
        need = len(self._cohort.due(self._cohort.tick))
        for req in rest:
            if budget <= 0:
                break
            n_new, blocks = self._demand(req, budget)
            need += blocks
            budget -= n_new
        return need <= self.pool.num_free

    def _demand(self, req: EngineRequest, budget: int) -> tuple[int, int]:
        """Tokens a running request is scheduled for under `budget`, and the new blocks they
        need (it holds exactly the blocks of its computed tokens)."""
        computed = req.num_computed
        n_new = min(req.num_tokens - computed, budget)
        return n_new, -(-(computed + n_new) // self.block_size) - len(req.blocks)

    def _schedule(self, now: float) -> tuple[list[tuple[EngineRequest, int]], list[EngineRequest]]:
        """The batch after the cohort (which gets one token each): running requests, then
        admitted ones; and whom it preempted."""
        cohort = self._cohort
        pool = self.pool
        for req in sorted(cohort.due(cohort.tick), key=_RUNNING_ORDER):
            req.blocks.extend(pool.allocate(1))
        budget = self.max_num_batched_tokens - cohort.size
        scheduled: list[tuple[EngineRequest, int]] = []
        preempted: list[EngineRequest] = []
        running = self.running

        i = cohort.size
        while i < len(running) and budget > 0:
            req = running[i]
            n_new, need = self._demand(req, budget)
            can_run = True
            while need > 0:
                new = pool.allocate(need)
                if new is not None:
                    req.blocks.extend(new)
                    break
                # (never a cohort member: this runs with a cohort only when nobody is preempted)
                victim = self._pick_victim()
                victim_index = running.index(victim)
                running.pop(victim_index)
                if victim_index < i:  # already scheduled this step: give its budget back
                    i -= 1
                    for k, (r, n) in enumerate(scheduled):
                        if r is victim:
                            budget += n
                            del scheduled[k]
                            break
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    can_run = False
                    break
            if not can_run:
                break  # as vLLM: a running request that cannot be scheduled ends this pass
            scheduled.append((req, n_new))
            budget -= n_new
            i += 1

        if not preempted:
            self._admit_waiting(now, budget, scheduled)
        return scheduled, preempted

    def _admit_waiting(self, now: float, budget: int, scheduled: list[tuple[EngineRequest, int]]) -> None:
        """Move waiting requests into the batch until the head does not fit."""
        pool = self.pool
        bs = self.block_size
        while budget > 0:
            req = self.waiting.peek()
            if req is None or len(self.running) >= self.max_num_seqs:
                return
            # Reuse the longest cached prefix, but always compute at least the last token; where
            # the GPU cache stops, the CPU tier may hold the next blocks (loaded, not recomputed).
            max_hit = (req.num_tokens - 1) // bs
            hit = pool.longest_cached_prefix(req.block_digests)[:max_hit]
            loaded = 0
            if pool.cpu_blocks and len(hit) < max_hit:
                loaded = min(pool.offloaded_run(req.block_digests, len(hit)), max_hit - len(hit))
            num_cached = (len(hit) + loaded) * bs
            remote = max(0, min(req.remote_tokens, req.num_tokens - 1) - num_cached)
            num_cached += remote
            n_new = min(req.num_tokens - num_cached, budget)
            need = num_blocks(num_cached + n_new, bs) - len(hit)
            if need + pool.count_free(hit) > pool.num_free:
                return
            pool.acquire(hit)
            req.blocks = hit + (pool.allocate(need) or [])
            req.num_computed = num_cached
            req.num_cached_tokens = num_cached
            req.num_registered = len(hit)
            if req.num_preemptions == 0:  # vLLM keeps re-prefills after preemption out of these
                self.counters.prefix_cache_queries += req.num_tokens
                self.counters.prefix_cache_hits += len(hit) * bs
                self.counters.external_prefix_cache_hits += loaded * bs
            self._loaded_tokens += loaded * bs
            self.counters.kv_transfer_tokens += remote
            self.waiting.pop()
            req.status = Status.RUNNING
            if req.scheduled_at is None:
                req.scheduled_at = now
            req._order = next(self._order)
            self.running.append(req)
            scheduled.append((req, n_new))
            budget -= n_new

    def _pick_victim(self) -> EngineRequest:
        if self.waiting.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

    def _preempt(self, req: EngineRequest) -> None:
        self.pool.release(req.blocks)
        req.blocks = []
        req.num_computed = 0
        req.num_registered = 0
        req.remote_tokens = 0
        req.num_preemptions += 1
        req.status = Status.PREEMPTED
        self.counters.num_preemptions += 1
        self.waiting.push(req, front=True)

    def _extension(self, scheduled: list[tuple[EngineRequest, int]], first_end: float,
                   horizon: float, batched: int, context: int) -> tuple[int, float]:
        """How many more identical decode steps fit before the horizon, the next finish and
        the next block shortage; and their total duration. `scheduled` is the batch less the
        cohort."""
        bs = self.block_size
        cohort = self._cohort
        tick = cohort.tick
        tokens_left = [min(r.max_output - r.num_output, self.max_model_len - r.num_tokens) for r, _ in scheduled]
        if cohort.size:
            tokens_left.append(cohort.first_finish() - tick)
        max_extra = min(tokens_left) - 1
        if max_extra <= 0:
            return 0, 0.0
        # Block headroom: extra step j (1-based) starts at tick + j, and needs one more block for
        # each request whose computed tokens are then a multiple of the block size. Counting
        # requests by that tick's residue makes each step O(1).
        free = self.pool.num_free
        blocks_due = cohort.blocks_due_by_residue()
        for r, _ in scheduled:
            blocks_due[(tick + 1 - r.num_tokens) % bs] += 1
        # (cohort members already hold the blocks of this step's tokens)
        base = sum(-(-r.num_tokens // bs) - len(r.blocks) for r, _ in scheduled)
        need = base
        extra = 0
        elapsed = 0.0
        start = first_end
        ctx = context
        p = self.profile
        step_fixed = p.a + p.b * batched
        while extra < max_extra and start < horizon:
            j = extra + 1
            need += blocks_due[(tick + j) % bs]
            if need > free:
                break
            ctx += batched
            d = step_fixed + p.c * ctx
            extra = j
            elapsed += d
            start += d
        return extra, elapsed

    def _apply(self, scheduled: list[tuple[EngineRequest, int]], num_decoders: int, num_steps: int,
               end: float) -> tuple[list[tuple[EngineRequest, int]], list[EngineRequest], list[EngineRequest]]:
        """Account the step's work: the cohort's `num_decoders` members in bulk, then the rest of
        the batch request by request. Returns the rest's (tokens, finished, started), with the
        cohort's finishes leading `finished`."""
        cohort = self._cohort
        counters = self.counters
        if num_steps > 1:
            self._extend_cohort_blocks(num_steps - 1)
        tokens, finished, started = self._apply_each(scheduled, num_steps, end)
        cohort.tick += num_steps
        counters.generation_tokens += num_decoders * num_steps
        finished[:0] = cohort.pop_finished()
        for req in finished:
            self.running.remove(req)
            self.pool.release(req.blocks)
            req.blocks = []
            req.status = Status.FINISHED
            req.finished_at = end
            reason = "stop" if req.ends_at_eos and req.num_output >= req.max_output else "length"
            req.finish_reason = reason
            counters.request_success[reason] += 1
            del self.requests[req.request_id]
        for req, _ in tokens:
            # decoding from now on, unless it still has prompt blocks to publish (digests
            # finer than the engine's blocks)
            if req.status is Status.RUNNING and req.num_registered >= len(req.block_digests):
                cohort.join(req)
        return tokens, finished, started

    def _extend_cohort_blocks(self, extra: int) -> None:
        """Give the cohort the blocks its `extra` more tokens each need, in running order (as
        `_apply_each` would). Only members due a block at one of those ticks need any."""
        cohort = self._cohort
        bs = self.block_size
        ticks = range(cohort.tick + 1, cohort.tick + min(extra, bs) + 1)
        crossing = itertools.chain.from_iterable(cohort.due(tick) for tick in ticks)
        for req in sorted(crossing, key=_RUNNING_ORDER):
            req.blocks.extend(self.pool.allocate(-(-(req.num_tokens + extra) // bs) - len(req.blocks)))

    def _apply_each(self, scheduled: list[tuple[EngineRequest, int]], num_steps: int,
                    end: float) -> tuple[list[tuple[EngineRequest, int]], list[EngineRequest], list[EngineRequest]]:
        """Account the requests outside the cohort, one by one."""
        pool = self.pool
        bs = self.block_size
        counters = self.counters
        tokens: list[tuple[EngineRequest, int]] = []
        finished: list[EngineRequest] = []
        started: list[EngineRequest] = []
        max_model_len = self.max_model_len
        extra = num_steps - 1
        for req, n in scheduled:
            computed = req.num_computed
            if computed < req.max_computed:
                counters.recomputed_tokens += min(n, req.max_computed - computed)
            num_tokens = req.num_tokens
            if extra:
                # extended decode: allocate the blocks the extra tokens need
                need = -(-(num_tokens + extra) // bs) - len(req.blocks)
                if need > 0:
                    req.blocks.extend(pool.allocate(need))
                computed += n + extra
            else:
                computed += n
            req.num_computed = computed
            if computed > req.max_computed:
                req.max_computed = computed
            digests = req.block_digests
            if req.num_registered < len(digests):
                while req.num_registered < len(digests) and (req.num_registered + 1) * bs <= computed:
                    pool.register(req.blocks[req.num_registered], digests[req.num_registered])
                    req.num_registered += 1
            if computed - extra < num_tokens:
                continue  # chunked prefill still in progress
            req.num_output += num_steps
            counters.generation_tokens += num_steps
            if req.first_token_at is None:
                req.first_token_at = end
                started.append(req)
                counters.prompt_tokens += req.prompt_len
                counters.prompt_tokens_cached += req.num_cached_tokens
            tokens.append((req, num_steps))
            if req.num_output >= req.max_output or req.num_tokens >= max_model_len:
                finished.append(req)
        return tokens, finished, started
