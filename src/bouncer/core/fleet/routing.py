"""Choosing a replica for an admitted request, among those admission found eligible.

A router only ranks candidates the core has already filtered (not busy, fresh or fail-open,
room for the request's KV). When none is eligible, routing defers to admission, which holds the
request. Routers are chosen by name (`policy.routing.router`, `bouncer.core.registry`). What each replica holds in its
prefix cache lives on the replica (`ReplicaState.prefix`), fed by the core on every dispatch and
by the engine's KV events where it publishes them.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from bouncer.config import Routing
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.prefix_index import ApproxPrefixIndex
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.requests import Admission

# SGLang's --max-tree-size default is 67,108,864 characters; at ~4 characters per token that is
# about this many of our 16-token blocks per replica.
SGLANG_TREE_BLOCKS = 67_108_864 // 4 // 16


class Router(Protocol):
    name: str

    def choose(self, adm: Admission, candidates: list[ReplicaState], view: PoolView, prefill_busy_tokens: int,
               backlogged: list[ReplicaState], cached: dict[str, int]) -> ReplicaState:
        """One of `candidates` (never empty). `backlogged` replicas are usable but full for now
        (prefill queue or KV headroom): a router may still send a request there when its cache
        makes up for the wait; the engine queues it. `cached`: the prompt tokens each of them
        holds (`cached_tokens`), computed once for this placement."""


def cached_tokens(r: ReplicaState, adm: Admission, now: float) -> int:
    """Prompt tokens of `adm` that `r` holds; never the whole prompt (the engine recomputes the
    last token to get logits, as vLLM does)."""
    digests = adm.info.block_digests
    if not digests:  # (a prompt shorter than a block, or one whose blocks were not hashed)
        return 0
    return min(r.prefix.match(digests, now) * r.block_size, adm.info.prompt_tokens - 1)


class RoundRobinRouter:
    name = "round-robin"

    def __init__(self, cfg: Routing | None = None) -> None:
        self._turn = itertools.count()

    def choose(self, adm, candidates, view, prefill_busy_tokens, backlogged, cached):
        return candidates[next(self._turn) % len(candidates)]


class LeastLoadedRouter:
    """Lowest projected KV usage plus prefill backlog (as a fraction of the busy threshold)."""

    name = "least-loaded"

    def __init__(self, cfg: Routing | None = None) -> None:
        pass

    def choose(self, adm, candidates, view, prefill_busy_tokens, backlogged, cached):
        return min(candidates, key=lambda r: r.projected_usage(view.now, view.is_fresh(r))
                   + r.queued_prefill_tokens / prefill_busy_tokens)


class LlmdScorerRouter:
    """llm-d's scheduling profile: weighted scorers, max score wins. Weights from llm-d's sample
    EndpointPickerConfig (queue-scorer 1, kv-cache-scorer 1, prefix-cache-scorer 3); prefix score
    = matched blocks / prompt blocks (matchLengthWeight 0) from the approximate prefix producer
    (what was sent there, LRU per server); kv score = 1 - KV usage; queue score min-max
    normalised over candidates."""

    name = "llmd-scorers"
    W_QUEUE, W_KV, W_PREFIX = 1.0, 1.0, 3.0

    def __init__(self, cfg: Routing | None = None) -> None:
        pass

    def choose(self, adm, candidates, view, prefill_busy_tokens, backlogged, cached):
        digests = adm.info.block_digests
        queues = [r.queue_depth(view.is_fresh(r)) for r in candidates]
        qmin, qmax = min(queues), max(queues)
        best, best_score = candidates[0], -1.0
        for r, q in zip(candidates, queues, strict=True):
            prefix = r.prefix.approx.match(digests) / len(digests) if digests else 0.0
            kv = 1.0 - min(1.0, r.projected_usage(view.now, view.is_fresh(r)))
            queue = 1.0 if qmax == qmin else 1.0 - (q - qmin) / (qmax - qmin)
            score = self.W_PREFIX * prefix + self.W_KV * kv + self.W_QUEUE * queue
            if score > best_score:
                best, best_score = r, score
        return best


class SglangCacheAwareRouter:
    """The SGLang model gateway's `cache_aware` policy (sgl-model-gateway/src/policies/cache_aware.rs,
    defaults in docs/advanced_features/sgl_model_gateway.md). Load is the router's own count of
    requests in flight per worker. When the pool is imbalanced (max - min > balance_abs_threshold
    AND max > min x balance_rel_threshold) the least loaded worker wins; otherwise the worker with
    the longest prefix match, if it covers more than cache_threshold of the prompt, else the
    worker with the smallest tree. Its tree records everything routed to a worker, pruned only
    by size (--max-tree-size): it does not age with the engine's cache. SGLang matches raw text
    over HTTP; here the match is over our token blocks, the same rule at block granularity."""

    name = "sglang-cache-aware"

    def __init__(self, cfg: Routing | None = None) -> None:
        cfg = cfg or Routing()
        self.cache_threshold = cfg.cache_threshold
        self.balance_abs = cfg.balance_abs_threshold
        self.balance_rel = cfg.balance_rel_threshold
        self.trees: dict[str, ApproxPrefixIndex] = {}

    def _tree(self, r: ReplicaState) -> ApproxPrefixIndex:
        tree = self.trees.get(r.name)
        if tree is None:
            tree = self.trees[r.name] = ApproxPrefixIndex(SGLANG_TREE_BLOCKS)
        return tree

    def choose(self, adm, candidates, view, prefill_busy_tokens, backlogged, cached):
        loads = [r.requests_in_flight for r in candidates]
        lo, hi = min(loads), max(loads)
        digests = adm.info.block_digests
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            best = candidates[loads.index(lo)]
        else:
            matches = [self._tree(r).match(digests) for r in candidates]
            top = max(matches)
            rate = top * candidates[0].block_size / adm.info.prompt_tokens
            if top and rate > self.cache_threshold:
                best = candidates[matches.index(top)]
            else:
                best = min(candidates, key=lambda r: len(self._tree(r)))
        self._tree(best).record(digests)
        return best


class PrefixAwareRouter:
    """Bouncer's router: cheapest replica by the weighted cost in `Routing`, where a warm prefix
    saves its prefill tokens; but the replica holding the longest cached prefix (the sticky one)
    keeps the request while its predicted TTFT is within the margin of the cheapest's, so a
    conversation stays where its cache is instead of being copied around the fleet. The same gate
    decides for a sticky replica that is full for now (backlogged): waiting there is often still
    sooner, and always cheaper for the fleet, than recomputing the prefix elsewhere. (Under
    overload this is what keeps hit rates up: otherwise the head of the queue goes to whichever
    replica freed up first.)"""

    name = "prefix-aware"

    def __init__(self, cfg: Routing | None = None) -> None:
        self.cfg = cfg or Routing()

    def choose(self, adm, candidates, view, prefill_busy_tokens, backlogged, cached):
        c = self.cfg
        prompt = adm.info.prompt_tokens
        best = sticky = None
        best_cost = float("inf")
        for r in candidates:
            hit = cached[r.name]
            cost = (c.queue_weight * r.queued_prefill_tokens + c.prefix_weight * (prompt - hit)) / prefill_busy_tokens \
                + c.kv_weight * r.projected_usage(view.now, view.is_fresh(r))
            if cost < best_cost:
                best, best_cost = r, cost
            if hit > (cached[sticky.name] if sticky else 0):
                sticky = r
        for r in backlogged:
            if cached[r.name] > (cached[sticky.name] if sticky else 0):
                sticky = r
        assert best is not None
        # Only a replica holding *more* of the prompt than the cheapest one has a claim: a prefix
        # every replica holds (a shared system prompt) ties them, and then cost alone decides.
        if sticky is not None and cached[sticky.name] > cached[best.name]:
            # predicted TTFT, in prefill tokens: the work queued there, then this prompt's uncached part
            ttft_sticky = sticky.queued_prefill_tokens + prompt - cached[sticky.name]
            ttft_best = best.queued_prefill_tokens + prompt - cached[best.name]
            if ttft_sticky <= ttft_best * (1 + c.sticky_margin) + c.sticky_slack_tokens:
                return sticky
        return best


