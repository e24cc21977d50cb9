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
3. The step lasts `profile.step_time(batched tokens, context tokens)`. A request whose every
   known token is computed samples one new token at the end of the step; it finishes when it
   has produced its target length (or hit `max_model_len`).

Nothing here reads a clock or does IO: callers pass `now` and get back when the step ends and
what it produced. The simulator may pass a `horizon` (the next external event): a step that is
pure decode and cannot admit anyone is then extended over as many identical-shape steps as fit
before the horizon, the next finish, or the next block shortage. That gives the same state and
timing as stepping one by one (tested) at a fraction of the cost.

Priorities use vLLM's polarity here (lower value served first), because this is a model of vLLM.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from bouncer.core.blocks import num_blocks
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
    # progress, vLLM's names
    num_computed: int = 0
    num_output: int = 0
    blocks: list[int] = field(default_factory=list)
    num_registered: int = 0  # prompt blocks made findable in the prefix cache
    num_cached_tokens: int = 0  # prefix-cache hit at the last (re)admission
    max_computed: int = 0  # high-water mark of num_computed: what lies below it is recomputation
    status: Status = Status.WAITING
    scheduled_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    _seq: int = 0  # tie-break for the priority queue

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
    tokens: list[tuple[EngineRequest, int]]  # new output tokens per request, produced at `end`
    finished: list[EngineRequest]
    preempted: list[EngineRequest]
    started: list[EngineRequest] = field(default_factory=list)  # whose first token this step produced


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
        running = sum(r.prompt_len - r.num_computed for r in self.running if not r.is_prefill_done)
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
        scheduled, preempted = self._schedule(now)
        if not scheduled:
            return None
        batched = 0
        context = 0
        for req, n in scheduled:
            batched += n
            context += req.num_computed + n
        duration = self.profile.step_time(batched, context)
        if self._loaded_tokens:
            # vLLM loads offloaded blocks asynchronously; charging the copy to the step that
            # admits the request errs on the slow side
            duration += self._loaded_tokens * self.profile.offload_load_s_per_token
        num_steps = 1
        pure_decode = batched == len(scheduled) and all(r.num_output > 0 for r, _ in scheduled)
        # A pure-decode step that preempted nobody admitted nobody either: the waiting head is
        # blocked by blocks, seats or budget, and stays blocked until a request finishes.
        if horizon is not None and pure_decode and not preempted:
            extra, extra_time = self._extension(scheduled, now + duration, horizon, batched, context)
            num_steps += extra
            duration += extra_time
        end = now + duration
        self.counters.steps += num_steps
        self.counters.busy_time += duration
        tokens, finished, started = self._apply(scheduled, num_steps, end)
        return StepResult(now, end, num_steps, batched, tokens, finished, preempted, started)

    def _schedule(self, now: float) -> tuple[list[tuple[EngineRequest, int]], list[EngineRequest]]:
        budget = self.max_num_batched_tokens
        bs = self.block_size
        pool = self.pool
        scheduled: list[tuple[EngineRequest, int]] = []
        preempted: list[EngineRequest] = []
        running = self.running

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            computed = req.num_computed
            n_new = req.prompt_len + req.num_output - computed  # num_tokens - num_computed, inlined: hot
            if n_new > budget:
                n_new = budget
            need = -(-(computed + n_new) // bs) - len(req.blocks)
            can_run = True
            while need > 0:
                new = pool.allocate(need)
                if new is not None:
                    req.blocks.extend(new)
                    break
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
            n_new = min(req.num_tokens - num_cached, budget)
            need = num_blocks(num_cached + n_new, bs) - len(hit)
            hit_free = sum(1 for b in hit if pool._ref_cnt[b] == 0)
            if need + hit_free > pool.num_free:
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
            self.waiting.pop()
            req.status = Status.RUNNING
            if req.scheduled_at is None:
                req.scheduled_at = now
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
        req.num_preemptions += 1
        req.status = Status.PREEMPTED
        self.counters.num_preemptions += 1
        self.waiting.push(req, front=True)

    def _extension(self, scheduled: list[tuple[EngineRequest, int]], first_end: float,
                   horizon: float, batched: int, context: int) -> tuple[int, float]:
        """How many more identical decode steps fit before the horizon, the next finish and
        the next block shortage; and their total duration."""
        bs = self.block_size
        max_extra = min(min(r.max_output - r.num_output, self.max_model_len - r.num_tokens)
                        for r, _ in scheduled) - 1
        if max_extra <= 0:
            return 0, 0.0
        # Block headroom: extra step j (1-based) needs num_tokens + j tokens of KV per request, so
        # it needs one more block for each request whose num_tokens + j - 1 is a multiple of the
        # block size. Counting requests by num_tokens mod block size makes each step O(1).
        free = self.pool.num_free
        residues = [0] * bs
        for r, _ in scheduled:
            residues[(r.prompt_len + r.num_output) % bs] += 1
        base = sum(-(-(r.prompt_len + r.num_output) // bs) - len(r.blocks) for r, _ in scheduled)
        need = base
        extra = 0
        elapsed = 0.0
        start = first_end
        ctx = context
        p = self.profile
        step_fixed = p.a + p.b * batched
        while extra < max_extra and start < horizon:
            j = extra + 1
            need += residues[(1 - j) % bs]
            if need > free:
                break
            ctx += batched
            d = step_fixed + p.c * ctx
            extra = j
            elapsed += d
            start += d
        return extra, elapsed

    def _apply(self, scheduled: list[tuple[EngineRequest, int]], num_steps: int,
               end: float) -> tuple[list[tuple[EngineRequest, int]], list[EngineRequest], list[EngineRequest]]:
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
            num_tokens = req.prompt_len + req.num_output
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
            if req.num_output >= req.max_output or req.prompt_len + req.num_output >= max_model_len:
                finished.append(req)
        if finished:
            self.running = [r for r in self.running if r.num_output < r.max_output
                            and r.prompt_len + r.num_output < max_model_len]
        for req in finished:
            pool.release(req.blocks)
            req.blocks = []
            req.status = Status.FINISHED
            req.finished_at = end
            req.finish_reason = "length"
            counters.request_success["length"] += 1
            del self.requests[req.request_id]
        return tokens, finished, started
