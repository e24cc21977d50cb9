"""Cache-aware routing: the prefix indexes (approximate and from KV events) and the routers."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from bouncer.config import Routing
from bouncer.core.fleet.blocks import chain_block_hashes, leading_run
from bouncer.core.fleet.cache_salt import salt_of
from bouncer.core.fleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, PreciseIndex
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.prefix_index import ApproxPrefixIndex, ReplicaPrefixIndex
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.fleet.routing import PrefixAwareRouter, SglangCacheAwareRouter, cached_tokens
from bouncer.core.registry import make_router
from bouncer.core.requests import Admission, RequestInfo
from core_helpers import admission_of, dispatched, info, make_core


def choose(router, adm, candidates, now, backlogged=()):
    """The router's pick, as placement calls it: every replica fresh, cached tokens computed once."""
    replicas = {r.name: r for r in [*candidates, *backlogged]}
    cached = {name: cached_tokens(r, adm, now) for name, r in replicas.items()}
    return router.choose(adm, list(candidates), PoolView(replicas, None, now), 16384, list(backlogged), cached)

TOKENS = list(range(1000, 1000 + 64 * 16))  # 64 blocks of 16
DIGESTS = chain_block_hashes(TOKENS)


def replica(name: str, blocks: int = 10_000) -> ReplicaState:
    return ReplicaState(name, "m", None, blocks, 16)


def admission(digests: list[int], prompt: int | None = None) -> Admission:
    prompt = prompt if prompt is not None else len(digests) * 16 + 5
    return Admission(RequestInfo("r", None, "m", prompt, 10, block_digests=digests), "a", 0, 10, 10, 0.0, 30.0, None)


# -- the indexes -----------------------------------------------------------------------------------
def test_only_a_contiguous_prefix_from_the_start_counts():
    idx = ApproxPrefixIndex(100)
    idx.record(DIGESTS[2:10])  # later blocks only
    assert idx.match(DIGESTS) == 0
    idx.record(DIGESTS[:1])
    assert idx.match(DIGESTS) == 1  # block 1 is missing, so blocks 2..9 do not count
    precise = PreciseIndex(16, 100)
    for d in DIGESTS[3:20]:
        precise.store(("GPU", d), (d,))
    assert precise.match(DIGESTS) == 0


def test_approximate_index_is_bounded_and_ages_out_least_recently_used():
    idx = ApproxPrefixIndex(10)
    a, b = DIGESTS[:6], chain_block_hashes(list(range(96)))
    idx.record(a)
    idx.record(b)  # 12 blocks for 10 slots: a's oldest blocks go
    assert len(idx) == 10
    assert idx.match(a) == 0 and idx.match(b) == 6
    idx.record(a[:2])  # touched again: now the most recent
    idx.record(chain_block_hashes(list(range(500, 500 + 5 * 16))))  # 5 more evict b's oldest, not a's
    assert idx.match(a) == 2 and idx.match(b) == 0


class OrderedDictLRU:
    """The approximate index as first written, one `OrderedDict` moved block by block: the
    specification `ApproxPrefixIndex`'s per-record bookkeeping must agree with exactly."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.blocks = capacity, OrderedDict()

    def match(self, digests: list[int]) -> int:
        return leading_run(digests, self.blocks)

    def record(self, digests: list[int]) -> int:
        held = None
        for i, d in enumerate(digests):
            if d in self.blocks:
                self.blocks.move_to_end(d)
            else:
                self.blocks[d] = None
                held = i if held is None else held
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return len(digests) if held is None else held

    def forget(self, digests: list[int]) -> None:
        for d in digests:
            self.blocks.pop(d, None)


@pytest.mark.parametrize("seed", range(60))
def test_approximate_index_agrees_with_a_block_by_block_lru_on_random_conversations(seed):
    """Conversations that extend (all but their last block, too), fork and retry each other,
    failed claims forgotten, capacity changed: every answer, what is held and its eviction order
    equal the reference's."""
    rng = random.Random(seed)
    capacity = rng.choice([5, 50, 300, 2000, 10**6])
    shortcuts = type("Index", (ApproxPrefixIndex,), {"__slots__": (), "SHORTCUT_MIN": rng.choice([1, 4, 64]),
                                                     "PROBE_BLOCKS": rng.choice([3, 50, 1024]),
                                                     "COMPACT_RATIO": rng.choice([0.01, 2.0])})
    index, reference = shortcuts(capacity), OrderedDictLRU(capacity)
    chains, fresh = [[]], iter(range(1, 10**9))
    for step in range(400):
        base, fork = rng.choice(chains), rng.random()
        if fork < 0.3:  # a fork from somewhere in it
            base = base[:rng.randrange(len(base) + 1)]
        elif fork < 0.5:  # its last block differs (a chat's generation prompt, answered)
            base = base[:-1]
        prompt = base + [next(fresh) for _ in range(rng.randrange(0, 120))]  # distinct ids: a chain's digests
        chains.append(prompt)
        if len(chains) > 30:
            chains.pop(rng.randrange(len(chains)))
        op = rng.random()
        if op < 0.6:
            assert index.record(prompt) == reference.record(prompt), step
        elif op < 0.65:
            index.forget(prompt)
            reference.forget(prompt)
        elif op < 0.7:
            index.capacity = reference.capacity = rng.choice([5, 50, 300, 2000])
        for other in rng.sample(chains, min(5, len(chains))):
            assert index.match(other) == reference.match(other), step
        assert len(index) == len(reference.blocks)
    # then one new block at a time, each evicting the least recently used: the same one, in the
    # reference's order
    index.capacity = reference.capacity = max(1, len(reference.blocks))
    while len(reference.blocks) > 1:
        oldest, after = list(reference.blocks)[:2]
        assert index.match([oldest]) == 1
        newest = [next(fresh)]
        index.record(newest), reference.record(newest)
        assert index.match([oldest]) == 0 and index.match([after]) == 1
        reference.forget(newest), index.forget(newest)
        index.capacity = reference.capacity = len(reference.blocks)


def test_agent_sessions_keep_the_approximate_indexs_bookkeeping_bounded():
    """Each step of a session extends its last one: the record it extends is taken over, so a
    gateway serving sessions for days keeps one record (and one remembered end) per session."""
    index, fresh = ApproxPrefixIndex(10**6), iter(range(1, 10**9))
    sessions = [[next(fresh) for _ in range(100)] for _ in range(5)]
    for step in range(400):
        k = step % 5
        sessions[k] = sessions[k] + [next(fresh) for _ in range(3)]
        assert index.record(sessions[k]) == (len(sessions[k]) - 3 if step >= 5 else 0)
    assert len(index) == sum(len(s) for s in sessions)
    assert len(index._records) == 5 and len(index._tails) == 10  # (internal: what it keeps besides the blocks)


def test_kv_events_in_engine_keys_map_onto_our_digests():
    """vLLM's CPU backend uses 128-token blocks and its own hashes: each engine block becomes 8
    of our 16-token digests, chained through the parent's engine key."""
    idx = PreciseIndex(16, 1000)
    idx.apply([BlockStored([b"e0", b"e1"], None, TOKENS[:256], 128)], now=1.0)
    assert idx.match(DIGESTS) == 16
    idx.apply([BlockStored([b"e2"], b"e1", TOKENS[256:384], 128)], now=2.0)
    assert idx.match(DIGESTS) == 24
    assert idx.last_event_at == 2.0
    idx.apply([BlockRemoved([b"e1"])], now=3.0)  # a hole: only the first block still counts
    assert idx.match(DIGESTS) == 8
    idx.apply([BlockStored([b"x"], b"never-seen", TOKENS[:128], 128)], now=4.0)
    assert idx.unplaced == 1  # its parent is unknown: not guessed
    idx.apply([AllBlocksCleared()], now=5.0)
    assert idx.match(DIGESTS) == 0 and len(idx) == 0


def test_a_prefix_offloaded_to_host_memory_still_counts_after_the_gpu_evicts_it():
    idx = PreciseIndex(16, 1000)
    idx.apply([BlockStored([b"e0"], None, TOKENS[:128], 128),
               BlockStored([b"e0"], None, [], 128, medium="CPU")], now=1.0)  # vLLM's offload copy: no tokens
    idx.apply([BlockRemoved([b"e0"])], now=2.0)  # gone from the GPU, still in host memory
    assert idx.match(DIGESTS) == 8
    idx.apply([BlockRemoved([b"e0"], medium="CPU")], now=3.0)
    assert idx.match(DIGESTS) == 0


def test_kv_events_with_a_block_size_we_cannot_cut_are_counted_not_guessed():
    idx = PreciseIndex(16, 1000)
    idx.apply([BlockStored([b"e0"], None, TOKENS[:24], 24)], now=1.0)
    assert idx.unplaced == 1 and len(idx) == 0


def test_precise_index_falls_back_to_approximate_when_events_stop():
    view = ReplicaPrefixIndex(1000, 16, events_staleness_s=5.0)
    view.record(DIGESTS[:4], now=0.0)  # what we sent: 4 blocks
    assert not view.events_live(0.0) and view.match(DIGESTS, 0.0) == 4
    view.apply_digests([("GPU", d) for d in DIGESTS[:10]], [], now=1.0)  # the engine says it holds 10
    assert view.events_live(1.0) and view.match(DIGESTS, 1.0) == 10
    assert view.events_live(100.0)  # idle: nothing sent since the last event, nothing to report
    view.record(DIGESTS[:12], now=101.0)
    view.record(DIGESTS[:12], now=104.0)
    assert view.events_live(105.0)  # first unanswered send 4 s ago, within the staleness window
    assert not view.events_live(106.5)  # sent, and no event for 5.5 s: the publisher went quiet
    assert view.match(DIGESTS, 106.5) == 12  # the approximate index was fed all along
    view.apply_digests([("GPU", d) for d in DIGESTS[:12]], [], now=107.0)  # it speaks again
    assert view.events_live(107.0) and view.match(DIGESTS, 107.0) == 12


def test_a_replicas_remembered_match_follows_every_change_of_either_index():
    """`ReplicaPrefixIndex.match` remembers its last answer for the same prompt (a long prompt is
    matched twice per core call): any change to what either index holds must be seen at once."""
    view = ReplicaPrefixIndex(1000, 16, events_staleness_s=5.0)
    view.record(DIGESTS[:4], now=0.0)
    assert view.match(DIGESTS, 0.0) == 4 and view.match(DIGESTS, 0.0) == 4
    view.record(DIGESTS[:9], now=0.1)  # sent more of it
    assert view.match(DIGESTS, 0.2) == 9
    view.forget(DIGESTS[6:9])  # a claim failed: not sent after all
    assert view.match(DIGESTS, 0.3) == 6
    view.approx.record(DIGESTS[:7])  # another gateway's blocks, recorded straight into the index
    assert view.match(DIGESTS, 0.4) == 7
    view.apply_digests([("GPU", d) for d in DIGESTS[:20]], [], now=1.0)  # the engine's events take over
    assert view.match(DIGESTS, 1.0) == 20
    view.apply_digests([], [("GPU", DIGESTS[3])], now=1.1)  # it evicted block 3
    assert view.match(DIGESTS, 1.1) == 3
    view.apply_events([AllBlocksCleared()], now=1.2)
    assert view.match(DIGESTS, 1.2) == 0
    other = DIGESTS[:5]  # an equal prompt in another list: asked afresh, same answer
    view.apply_digests([("GPU", d) for d in DIGESTS[:5]], [], now=1.3)
    assert view.match(other, 1.3) == 5 and view.match(DIGESTS, 1.3) == 5


def test_precise_index_is_bounded_even_if_removals_are_lost():
    idx = PreciseIndex(16, 5)
    for d in DIGESTS[:8]:
        idx.store(("GPU", d), (d,))
    assert len(idx) == 5 and idx.match(DIGESTS) == 0 and idx.match(DIGESTS[3:]) == 5


# -- the routers ---------------------------------------------------------------------------------
def test_prefix_aware_goes_where_the_prefix_is_warm():
    warm, cold = replica("warm"), replica("cold")
    warm.prefix.record(DIGESTS, 0.0)
    router = PrefixAwareRouter()
    assert choose(router, admission(DIGESTS), [cold, warm], 1.0, []) is warm


def test_sticky_replica_keeps_the_request_within_the_margin_and_loses_it_beyond():
    cfg = Routing(sticky_margin=0.5, sticky_slack_tokens=0, kv_weight=10.0)
    sticky, other = replica("sticky"), replica("other")
    adm = admission(DIGESTS[:32], prompt=1000)
    sticky.prefix.record(DIGESTS[:32], 0.0)  # holds the whole prompt: 999 tokens cached
    # sticky's KV is fuller, so by cost alone `other` wins; its predicted TTFT (prefill tokens
    # ahead plus its own) is 400 + 1 against other's 300 + 1000: well within the margin
    sticky.queued_prefill_tokens, other.queued_prefill_tokens = 400, 300
    sticky.inflight_blocks = 9000  # 90% KV by our own accounting
    router = PrefixAwareRouter(cfg)
    assert choose(router, adm, [sticky, other], 1.0, []) is sticky
    # a long queue on the sticky replica: 3,000 + 1 > 1.5 x (0 + 1,000)
    sticky.queued_prefill_tokens, other.queued_prefill_tokens = 3000, 0
    assert choose(router, adm, [sticky, other], 1.0, []) is other


def test_a_warm_replica_with_a_full_prefill_queue_keeps_its_claim_within_the_margin():
    cfg = Routing(sticky_margin=0.5, sticky_slack_tokens=0)
    warm, cold = replica("warm"), replica("cold")
    adm = admission(DIGESTS[:40], prompt=12_000)  # 640 tokens cached on `warm`
    warm.prefix.record(DIGESTS[:40], 0.0)
    router = PrefixAwareRouter(cfg)
    # over the busy threshold, but 17,000 + 11,360 tokens ahead is within 1.5 x (9,000 + 12,000)
    warm.queued_prefill_tokens, cold.queued_prefill_tokens = 17_000, 9_000
    assert choose(router, adm, [cold], 1.0, [warm]) is warm
    # far over: 40,000 + 11,360 > 31,500
    warm.queued_prefill_tokens = 40_000
    assert choose(router, adm, [cold], 1.0, [warm]) is cold


def test_sglang_cache_aware_follows_its_documented_rule():
    router = SglangCacheAwareRouter(Routing())
    a, b = replica("a"), replica("b")
    first = choose(router, admission(DIGESTS[:20]), [a, b], 0.0, [])
    # balanced and a match over the 0.3 threshold: back to the same worker
    assert choose(router, admission(DIGESTS[:20]), [a, b], 0.0, []) is first
    # a prompt matching 5 of 20 blocks (25% < 30%): the smaller tree wins
    other = b if first is a else a
    partial = DIGESTS[:5] + chain_block_hashes(list(range(15 * 16)), parent=DIGESTS[4])
    assert choose(router, admission(partial), [a, b], 0.0, []) is other
    # imbalanced (100 vs 10 in flight: diff > 64 and ratio > 1.5): shortest queue, warm or not
    first.inflight = {str(i): None for i in range(100)}
    other.inflight = {str(i): None for i in range(10)}
    assert choose(router, admission(DIGESTS[:20]), [a, b], 0.0, []) is other
    # 100 vs 40: diff 60 is under the absolute threshold, so still cache-aware
    other.inflight = {str(i): None for i in range(40)}
    assert choose(router, admission(DIGESTS[:20]), [a, b], 0.0, []) is first


def test_routers_are_chosen_by_name_and_unknown_names_are_refused():
    for name in ("round-robin", "least-loaded", "llmd-scorers", "sglang-cache-aware", "prefix-aware"):
        assert make_router(name).name == name
    try:
        make_router("random")
    except ValueError as exc:
        assert "sglang-cache-aware" in str(exc)
    else:
        raise AssertionError("an unknown router was accepted")


def test_core_counts_only_uncached_prompt_tokens_as_queued_prefill():
    core = make_core(replicas=1)
    first = core.offer(info(prompt=64 * 16 + 5, block_digests=DIGESTS), 0.0)
    (d,) = dispatched(first)
    r = core.replicas[d.replica]
    assert r.queued_prefill_tokens == 64 * 16 + 5
    second = dispatched(core.offer(info(prompt=64 * 16 + 5, block_digests=DIGESTS), 0.1))
    assert second and admission_of(core, second[0]).prefill_tokens == 5  # the whole prefix was just sent there


def test_core_routes_by_kv_events_and_reports_the_index_mode():
    core = make_core(replicas=2)
    names = list(core.replicas)
    # its blocks as vLLM reports them: under the salt the gateway gave tenant a's request
    core.kv_events(names[1], [BlockStored(["k0"], None, TOKENS[:128], 16 * 8, salt=salt_of("a"))], 0.5)
    snap = core.snapshot(0.5)["models"]["m"]["replicas"]
    assert snap[names[1]]["prefix_index"]["mode"] == "precise"
    assert snap[names[1]]["prefix_index"]["precise_blocks"] == 8
    assert snap[names[0]]["prefix_index"]["mode"] == "approximate"
    (d,) = dispatched(core.offer(info(prompt=8 * 16 + 3, block_digests=DIGESTS[:8]), 1.0))
    assert d.replica == names[1]


def test_the_router_is_chosen_by_config_and_swapped_by_a_reload():
    from bouncer.config import parse_config
    from core_helpers import make_config

    core = make_core()
    assert core.placement.router.name == "prefix-aware"  # the default
    before = core.placement.router
    core.reload(parse_config(make_config()), 1.0)
    assert core.placement.router is before  # an unrelated reload keeps its state
    core.reload(parse_config(make_config(policy={"routing": {"router": "sglang-cache-aware"}})), 2.0)
    assert core.placement.router.name == "sglang-cache-aware"
