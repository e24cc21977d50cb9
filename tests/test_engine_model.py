"""The engine model against vLLM v1's behaviour, with explicit virtual time."""

from __future__ import annotations

import dataclasses
import random
from collections import OrderedDict

import pytest

from bouncer.core.fleet.blocks import chain_block_hashes, num_blocks
from bouncer.sim.engine import EngineModel, EngineRequest, QueueFull, RequestTooLong, Status
from bouncer.sim.kv_pool import KVPool
from bouncer.sim.profiles import PROFILES, EngineProfile, KVGeometry

# A small, round profile so expected step times are easy to write down.
TOY = EngineProfile(name="toy", model="toy", hardware="none", a=0.010, b=0.001, c=0.0001,
                    kv=KVGeometry(layers=2, kv_heads=2, head_dim=8), num_blocks=64, block_size=16,
                    max_num_batched_tokens=512, max_num_seqs=8, max_model_len=4096)


def req(rid: str, prompt: list[int] | int, out: int, at: float = 0.0, priority: int = 0) -> EngineRequest:
    tokens = list(range(prompt)) if isinstance(prompt, int) else prompt
    return EngineRequest(rid, len(tokens), out, chain_block_hashes(tokens, 16), at, priority)


def run_to_idle(engine: EngineModel, now: float = 0.0, horizon: float | None = None, limit: int = 100000):
    """Step until nothing is left; return (end time, finished requests in order, step results)."""
    finished, results = [], []
    for _ in range(limit):
        res = engine.step(now, horizon)
        if res is None:
            return now, finished, results
        results.append(res)
        finished.extend(res.finished)
        now = res.end
    raise AssertionError("engine did not go idle")


def test_step_time_follows_profile():
    engine = EngineModel(TOY)
    engine.add_request(req("a", 100, 3))
    res = engine.step(0.0)
    # prefill: 100 tokens batched, 100 tokens of context
    assert res.batched_tokens == 100
    assert res.end == pytest.approx(0.010 + 0.001 * 100 + 0.0001 * 100)
    assert res.tokens == [(engine.running[0], 1)]  # the first token is sampled at prefill's end
    res2 = engine.step(res.end)
    # decode: 1 batched token, context 101 (100 prompt + the first output token)
    assert res2.end - res.end == pytest.approx(0.010 + 0.001 * 1 + 0.0001 * 101)


def test_prompt_chunks_pay_attention_compute_quadratic_in_the_prompt():
    """d is charged per (token computed, token at or before it): a prompt's total is
    P (P + 1) / 2 pairs however it is chunked, and decode steps pay none."""
    plain = dataclasses.replace(TOY, num_blocks=512)
    quad = dataclasses.replace(plain, d=1e-7)
    runs = []
    for profile in (plain, quad):
        engine = EngineModel(profile)
        engine.add_request(req("a", 3000, 4))  # six 512-token chunks
        _, finished, _ = run_to_idle(engine)
        runs.append(finished[0])
    assert runs[1].first_token_at - runs[0].first_token_at == pytest.approx(1e-7 * 3000 * 3001 / 2)
    decode = [r.finished_at - r.first_token_at for r in runs]
    assert decode[1] == pytest.approx(decode[0])
    # the published GPU profiles derive d from the model's attention FLOPs
    llama8 = PROFILES["llama-3.1-8b-h100"]
    assert llama8.d == pytest.approx(4 * 32 * 32 * 128 / (989e12 * 0.6))
    assert llama8.step_time_config["d"] == llama8.d


def test_chunked_prefill_splits_long_prompt_over_budget():
    engine = EngineModel(dataclasses.replace(TOY, num_blocks=128))
    engine.add_request(req("long", 1200, 2))
    budgets = []
    now = 0.0
    while True:
        res = engine.step(now)
        budgets.append(res.batched_tokens)
        now = res.end
        if res.tokens:
            break
    assert budgets == [512, 512, 176]


def test_shared_prefix_is_prefilled_once_then_hit():
    engine = EngineModel(TOY)
    shared = list(range(1000, 1000 + 160))  # 10 full blocks
    engine.add_request(req("first", shared + [1, 2, 3], 2))
    now, _, _ = run_to_idle(engine)
    assert engine.counters.prefix_cache_hits == 0
    engine.add_request(req("second", shared + [7, 8, 9, 10], 2, at=now))
    res = engine.step(now)
    # 160 tokens come from the cache: only the 4-token tail is computed
    assert res.batched_tokens == 4
    assert engine.counters.prefix_cache_hits == 160
    assert engine.counters.prefix_cache_queries == 163 + 164


def test_prefix_hit_needs_contiguous_blocks_from_the_start():
    engine = EngineModel(TOY)
    engine.add_request(req("a", list(range(64)), 1))
    run_to_idle(engine)
    # same tokens in blocks 1..3 but a different block 0: chained digests differ, no hit
    engine.add_request(req("b", [9999] * 16 + list(range(16, 64)), 1))
    res = engine.step(0.0)
    assert res.batched_tokens == 64
    assert engine.counters.prefix_cache_hits == 0


def test_cached_blocks_are_evicted_lru_tail_first_when_memory_is_needed():
    profile = dataclasses.replace(TOY, num_blocks=8)
    engine = EngineModel(profile)
    engine.add_request(req("a", list(range(64)), 1))  # 4 blocks, cached after finishing
    run_to_idle(engine)
    assert engine.pool.num_cached == 4 and engine.kv_usage == 0.0
    engine.add_request(req("b", list(range(500, 612)), 1))  # 7 blocks
    run_to_idle(engine)
    # b took the 4 never-used blocks, then 3 of a's: a's blocks were freed tail first, so its
    # last blocks went and its first block (the most shareable prefix) is still cached.
    engine.add_request(req("c", list(range(64)), 1))
    engine.step(0.0)
    assert engine.counters.prefix_cache_hits == 16


def test_a_prefix_evicted_from_the_gpu_is_loaded_back_from_the_cpu_tier():
    """vLLM's KV offloading: blocks are copied to host memory once computed; a prefix the GPU
    evicted is loaded back over PCIe (charged to the step) instead of recomputed."""
    profile = dataclasses.replace(TOY, num_blocks=8)
    events = []
    engine = EngineModel(profile, cpu_offload_blocks=100, kv_event_sink=lambda kind, d: events.append((kind, d)))
    engine.add_request(req("a", list(range(64)), 1))
    run_to_idle(engine)
    engine.add_request(req("b", list(range(500, 612)), 1))  # evicts a's last 3 blocks from the GPU
    run_to_idle(engine)
    assert any(kind == "removed" for kind, _ in events)
    offloaded = {d for kind, ds in events if kind == "offloaded" for d in ds}
    assert len(offloaded) == 4 + 7  # every computed block, write-through
    engine.add_request(req("c", list(range(64)) + [7], 1))
    res = engine.step(0.0)
    c = engine.counters
    assert c.prefix_cache_hits == 16  # block 0 still on the GPU
    assert c.external_prefix_cache_hits == 48  # blocks 1..3 from host memory
    assert res.batched_tokens == 1  # only the tail is computed
    load = 48 * profile.offload_load_s_per_token
    assert res.end == pytest.approx(profile.step_time(1, 65) + load)
    # without the CPU tier the same request recomputes 48 tokens
    plain = EngineModel(profile)
    plain.add_request(req("a", list(range(64)), 1))
    run_to_idle(plain)
    plain.add_request(req("b", list(range(500, 612)), 1))
    run_to_idle(plain)
    plain.add_request(req("c", list(range(64)) + [7], 1))
    assert plain.step(0.0).batched_tokens == 49


def test_the_cpu_tier_is_bounded_and_drops_least_recently_used():
    events = []
    engine = EngineModel(TOY, cpu_offload_blocks=5, kv_event_sink=lambda kind, d: events.append((kind, d)))
    engine.add_request(req("a", list(range(64)), 1))  # 4 blocks
    engine.add_request(req("b", list(range(500, 564)), 1))  # 4 more: 3 of the oldest are dropped
    run_to_idle(engine)
    dropped = [d for kind, ds in events if kind == "dropped" for d in ds]
    assert len(dropped) == 3 and len(engine.pool._cpu) == 5


def test_kv_exhaustion_preempts_last_admitted_and_recomputes():
    profile = dataclasses.replace(TOY, num_blocks=12, max_num_seqs=8)
    engine = EngineModel(profile)
    for i in range(3):  # 3 x (64 prompt tokens = 4 blocks) = 12 blocks: pool full after prefill
        engine.add_request(req(f"r{i}", list(range(i * 100, i * 100 + 64)), 40))
    res = engine.step(0.0)
    assert engine.kv_usage == 1.0 and not res.preempted
    res = engine.step(res.end)  # every request needs a 5th block for token 65: someone must go
    assert [r.request_id for r in res.preempted] == ["r2"]  # FCFS: the last admitted
    victim = res.preempted[0]
    assert victim.status is Status.PREEMPTED and victim.num_computed == 0 and victim.blocks == []
    assert victim.num_output == 1  # its output so far is kept
    assert engine.counters.num_preemptions == 1
    assert engine.num_waiting == 1
    now, finished, _ = run_to_idle(engine, res.end)
    assert {r.request_id for r in finished} == {"r0", "r1", "r2"}
    assert all(r.num_output == 40 for r in finished)
    # r2 recomputed prompt + kept output: more prompt-side work than its 64 tokens
    assert engine.counters.prompt_tokens == 3 * 64
    assert engine.kv_usage == 0.0


def test_priority_policy_preempts_lowest_priority():
    profile = dataclasses.replace(TOY, num_blocks=12)
    engine = EngineModel(profile, policy="priority")
    engine.add_request(req("low", list(range(0, 64)), 40, priority=5))
    engine.add_request(req("high", list(range(100, 164)), 40, priority=0))
    engine.add_request(req("mid", list(range(200, 264)), 40, priority=1))
    res = engine.step(0.0)
    res = engine.step(res.end)
    assert [r.request_id for r in res.preempted] == ["low"]


def test_waiting_queue_grows_when_blocks_run_out_and_drains():
    profile = dataclasses.replace(TOY, num_blocks=20, max_num_seqs=64)
    engine = EngineModel(profile)
    for i in range(12):
        engine.add_request(req(f"r{i}", list(range(i * 1000, i * 1000 + 60)), 30))
    res = engine.step(0.0)
    assert engine.num_running < 12 and engine.num_waiting > 0
    peak_waiting = engine.num_waiting
    now, finished, _ = run_to_idle(engine, res.end)
    assert peak_waiting >= 6
    assert len(finished) == 12 and engine.num_waiting == 0 and engine.num_running == 0


def test_max_num_seqs_caps_the_batch():
    engine = EngineModel(dataclasses.replace(TOY, max_num_seqs=3))
    for i in range(5):
        engine.add_request(req(f"r{i}", list(range(i * 100, i * 100 + 20)), 5))
    engine.step(0.0)
    assert engine.num_running == 3 and engine.num_waiting == 2


def test_queue_caps_refuse_like_vllm():
    engine = EngineModel(TOY, max_num_queued_reqs=2, max_num_queued_tokens=150)
    engine.add_request(req("a", 100, 5))
    with pytest.raises(QueueFull) as excinfo:
        engine.add_request(req("b", 100, 5))  # 200 queued prompt tokens > 150
    assert excinfo.value.reason == "max_num_queued_tokens"
    engine.add_request(req("c", 20, 5))
    with pytest.raises(QueueFull) as excinfo:
        engine.add_request(req("d", 10, 5))  # running + waiting already 2
    assert excinfo.value.reason == "max_num_queued_reqs"
    assert engine.counters.admission_rejections == {"max_num_queued_reqs": 1, "max_num_queued_tokens": 1}


def test_only_prompts_longer_than_the_context_are_refused():
    engine = EngineModel(dataclasses.replace(TOY, num_blocks=512, max_model_len=1000))
    with pytest.raises(RequestTooLong):
        engine.add_request(req("big", 1001, 1))
    # prompt + max_tokens beyond the context is accepted (as vLLM 0.32) and stops at the context
    engine.add_request(req("long-answer", 900, 500))
    _, finished, _ = run_to_idle(engine)
    assert finished[0].num_output == 100 and finished[0].finish_reason == "length"
    with pytest.raises(RequestTooLong):  # more KV than a shrunk pool holds: refused, not stuck
        EngineModel(dataclasses.replace(TOY, num_blocks=4)).add_request(req("kv", 100, 10))


def test_abort_frees_blocks_wherever_the_request_is():
    engine = EngineModel(dataclasses.replace(TOY, max_num_seqs=1))
    engine.add_request(req("run", 100, 50))
    engine.add_request(req("wait", 100, 50))
    engine.step(0.0)
    assert engine.kv_usage > 0
    engine.abort("wait", 0.1)
    engine.abort("run", 0.1)
    assert engine.kv_usage == 0.0 and not engine.has_work
    assert engine.counters.request_success["abort"] == 2
    assert engine.abort("run", 0.2) is None  # idempotent


def _trace_run(horizon: bool):
    profile = dataclasses.replace(TOY, num_blocks=40, max_num_seqs=6)
    engine = EngineModel(profile)
    arrivals = [(i * 0.05, req(f"r{i}", list(range(i * 50, i * 50 + 30 + 7 * i)), 20 + 3 * i, at=i * 0.05))
                for i in range(25)]
    now, done = 0.0, {}
    pending = list(arrivals)
    while pending or engine.has_work:
        while pending and pending[0][0] <= now:
            engine.add_request(pending.pop(0)[1])
        res = engine.step(now, pending[0][0] if (horizon and pending) else (float("inf") if horizon else None))
        if res is None:
            now = pending[0][0]
            continue
        for r in res.finished:
            done[r.request_id] = (r.first_token_at, r.finished_at, r.num_preemptions)
        now = res.end
    return done, engine.counters


def test_extended_decode_steps_match_single_steps():
    single, c1 = _trace_run(horizon=False)
    extended, c2 = _trace_run(horizon=True)
    assert single.keys() == extended.keys() and len(single) == 25
    for rid in single:
        assert extended[rid][0] == pytest.approx(single[rid][0], abs=1e-9)
        assert extended[rid][1] == pytest.approx(single[rid][1], abs=1e-9)
        assert extended[rid][2] == single[rid][2]
    assert c1.generation_tokens == c2.generation_tokens
    assert c1.num_preemptions == c2.num_preemptions
    assert c2.steps == c1.steps  # extension counts every step it covers


def test_published_profiles_are_sane():
    for profile in PROFILES.values():
        assert 0.003 < profile.a < 0.05
        assert profile.kv_tokens > 100_000
        # a 4k-token prefill chunk should take longer than a decode step, and far less than a second
        assert profile.a < profile.step_time(4096, 4096) < 1.0


# -- the decode cohort against per-request accounting ---------------------------------------------

def per_request(engine: EngineModel) -> EngineModel:
    """The same engine with its decode cohort switched off: nobody ever joins it, so every
    request is scheduled and accounted one by one, every step (the plain vLLM loop)."""
    engine._cohort.join = lambda req: None
    return engine


def _random_case(seed: int):
    rng = random.Random(seed)
    bs = rng.choice([16, 16, 8, 32])  # digests are made for 16: finer or coarser engine blocks
    profile = dataclasses.replace(
        TOY, num_blocks=rng.randint(24, 160), max_num_seqs=rng.choice([2, 4, 8, 32]),
        max_num_batched_tokens=rng.choice([6, 24, 96, 512]), max_model_len=rng.choice([200, 4096]))
    kwargs = dict(block_size=bs, policy=rng.choice(["fcfs", "priority"]),
                  cpu_offload_blocks=rng.choice([0, 0, 40]))
    prefixes = [list(range(k * 1000, k * 1000 + rng.randint(16, 120))) for k in range(3)]
    specs = []
    t = 0.0
    for i in range(rng.randint(10, 40)):
        t += rng.expovariate(20.0)
        prompt = (rng.choice(prefixes) if rng.random() < 0.6 else []) + \
            [rng.randrange(10**6) for _ in range(rng.randint(1, 80))]
        prompt = prompt[:profile.max_model_len]
        out = rng.randint(1, 60)
        if num_blocks(len(prompt) + out, bs) > profile.num_blocks:
            continue
        specs.append((t, f"r{i}", prompt, out, rng.randint(0, 3)))
    aborts = {spec[1]: spec[0] + rng.uniform(0.0, 1.0) for spec in specs if rng.random() < 0.15}
    horizons = [rng.choice([None, "arrival", "far"]) for _ in range(100_000)]
    return profile, kwargs, specs, aborts, horizons


def _request_state(r: EngineRequest):
    return (r.request_id, r.status, r.num_output, r.num_computed, r.max_computed, list(r.blocks),
            r.num_registered, r.num_cached_tokens, r.scheduled_at, r.first_token_at, r.finished_at,
            r.finish_reason, r.num_preemptions)


def _drive(engine: EngineModel, specs, aborts, horizons, events):
    """Replay the case, recording every step's result and the engine's state after it."""
    requests = {rid: EngineRequest(rid, len(p), out, chain_block_hashes(p, 16), t, prio)
                for t, rid, p, out, prio in specs}
    pending = sorted(specs)
    abort_at = sorted((t, rid) for rid, t in aborts.items())
    trace = []
    now = 0.0
    for kind in horizons:
        while abort_at and abort_at[0][0] <= now:
            aborted = engine.abort(abort_at.pop(0)[1], now)
            trace.append(("abort", aborted and _request_state(aborted)))
        while pending and pending[0][0] <= now:
            engine.add_request(requests[pending.pop(0)[1]])
        upcoming = ([pending[0][0]] if pending else []) + ([abort_at[0][0]] if abort_at else [])
        next_event = min(upcoming, default=None)
        horizon = {"arrival": next_event, "far": float("inf"), None: None}[kind]
        res = engine.step(now, horizon)
        if res is None:
            if next_event is None:
                break
            now = max(now, next_event)
            continue
        trace.append(((res.start, res.end, res.num_steps, res.batched_tokens),
                      [(r.request_id, n) for r, n in res.tokens],
                      [r.request_id for r in res.finished], [r.request_id for r in res.preempted],
                      [r.request_id for r in res.started],
                      [_request_state(r) for r in engine.running],
                      [r.request_id for r in engine.waiting],
                      dataclasses.asdict(engine.counters), engine.pool.num_free, len(events)))
        now = res.end
    trace.append([_request_state(r) for r in requests.values()])
    return trace


def _record(seed: int, cohort: bool):
    profile, kwargs, specs, aborts, horizons = _random_case(seed)
    events = []
    engine = EngineModel(profile, kv_event_sink=lambda kind, d: events.append((kind, d)), **kwargs)
    if not cohort:
        per_request(engine)
    return _drive(engine, specs, aborts, horizons, events), events


@pytest.mark.parametrize("seed", range(60))
def test_the_decode_cohort_steps_exactly_as_request_by_request(seed):
    """Preemption, chunked prefill, prefix (and CPU-tier) hits, aborts, both policies, extended
    steps: the cohort must give the same results, state, block ids and cache events."""
    fast, fast_events = _record(seed, cohort=True)
    slow, slow_events = _record(seed, cohort=False)
    assert len(fast) == len(slow)
    for step, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert a == b, f"diverged at step {step}"
    assert fast_events == slow_events


class _CountingEngine(EngineModel):
    """Counts the steps its cohort carries (with more than one member) and those that dissolve it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.led = self.dissolved = 0

    def _cohort_runs_as_is(self) -> bool:
        runs = super()._cohort_runs_as_is()
        self.led += runs and self._cohort.size > 1
        self.dissolved += not runs
        return runs


def test_random_cases_cover_the_cohort_and_its_fallbacks():
    """The cases above exercise what they claim: a cohort that carries the batch, and steps
    that dissolve it (a block shortage that preempts, a request left out of the cohort)."""
    led = dissolved = preemptions = 0
    for seed in range(60):
        profile, kwargs, specs, aborts, horizons = _random_case(seed)
        engine = _CountingEngine(profile, **kwargs)
        _drive(engine, specs, aborts, horizons, [])
        led += engine.led
        dissolved += engine.dissolved
        preemptions += engine.counters.num_preemptions
    assert led > 2000 and dissolved > 200 and preemptions > 50


def test_request_progress_reads_the_same_inside_and_outside_the_cohort():
    engine = EngineModel(TOY)
    engine.add_request(req("a", 40, 30))
    engine.add_request(req("b", 20, 30))
    now = engine.step(0.0).end  # both prefilled in one step, and now decoding
    a = engine.requests["a"]
    assert a._cohort is not None
    for _ in range(5):
        now = engine.step(now).end
    assert (a.num_output, a.num_computed, a.max_computed, a.num_tokens) == (6, 45, 45, 46)
    assert len(a.blocks) == 3  # 45 computed tokens: the third block came at token 33
    engine.abort("a", now)  # leaves the cohort with its progress written back
    assert a._cohort is None and (a.num_output, a.max_computed) == (6, 45)
    assert engine._cohort.size == 1


def test_step_tokens_list_every_request_in_batch_order():
    engine = EngineModel(dataclasses.replace(TOY, num_blocks=128))
    for i in range(3):
        engine.add_request(req(f"d{i}", 20 + i, 50))
    now = engine.step(0.0).end
    engine.add_request(req("p", 300, 5, at=now))
    res = engine.step(now)  # three decoders (the cohort), then the newcomer's prefill
    assert [(r.request_id, n) for r, n in res.tokens] == [("d0", 1), ("d1", 1), ("d2", 1), ("p", 1)]
    assert res.started == [engine.requests["p"]]


# -- the KV pool against a plain LRU model --------------------------------------------------------

class _ReferencePool:
    """The pool as first written: reference counts per block and an OrderedDict of free blocks."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.free = OrderedDict.fromkeys(range(num_blocks))
        self.digest: dict[int, int] = {}  # block -> digest
        self.cached: dict[int, int] = {}  # digest -> block

    def allocate(self, n):
        if n > len(self.free):
            return None, []
        out, removed = [], []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            if block in self.digest:
                removed.append(self.digest.pop(block))
                del self.cached[removed[-1]]
            self.ref[block] = 1
            out.append(block)
        return out, removed

    def release(self, blocks):
        for block in reversed(blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None

    def acquire(self, blocks):
        for block in blocks:
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1

    def register(self, block, digest):
        if block not in self.digest and digest not in self.cached:
            self.digest[block] = digest
            self.cached[digest] = block


@pytest.mark.parametrize("seed", range(20))
def test_kv_pool_allocates_and_evicts_as_a_plain_lru(seed):
    rng = random.Random(seed)
    num_blocks = rng.choice([8, 32, 100])
    events = []
    pool = KVPool(num_blocks, 16, event_sink=lambda kind, d: events.append((kind, d)))
    ref = _ReferencePool(num_blocks)
    held: list[list[int]] = []  # one list per holder, as requests hold them
    digests = [rng.randrange(2**62) for _ in range(3 * num_blocks)]
    for _ in range(3000):
        op = rng.random()
        if op < 0.35:
            n = rng.randint(1, 6)
            events.clear()
            got = pool.allocate(n)
            want, removed = ref.allocate(n)
            assert got == want
            assert [d for kind, ds in events if kind == "removed" for d in ds] == removed
            if got:
                held.append(got)
        elif op < 0.65 and held:
            blocks = held.pop(rng.randrange(len(held)))
            pool.release(blocks)
            ref.release(blocks)
        elif op < 0.8 and held:
            blocks = rng.choice(held)
            k = rng.randrange(len(blocks))
            digest = rng.choice(digests)
            pool.register(blocks[k], digest)
            ref.register(blocks[k], digest)
        else:
            chain = rng.sample(list(ref.cached), k=min(len(ref.cached), rng.randint(0, 4)))
            hit = pool.longest_cached_prefix(chain)
            assert hit == [ref.cached[d] for d in chain]
            assert pool.count_free(hit) == sum(1 for b in hit if ref.ref[b] == 0)
            pool.acquire(hit)
            ref.acquire(hit)
            if hit:
                held.append(hit)
        assert pool.num_free == len(ref.free)
        assert pool.num_cached == len(ref.cached)
