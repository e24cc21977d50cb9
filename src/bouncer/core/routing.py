"""Choosing a replica for an admitted request, among those admission found eligible.

A router only ranks candidates the core has already filtered (not busy, fresh or fail-open,
room for the request's KV). When none is eligible, routing defers to admission, which holds the
request. Routers are chosen by name.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from bouncer.core.fleet import ReplicaState
from bouncer.core.prefix_index import ApproxPrefixIndex
from bouncer.core.requests import Admission

DEFAULT_INDEX_BLOCKS = 100_000  # index bound when a replica's KV size is not known yet


class Router(Protocol):
    name: str

    def choose(self, adm: Admission, candidates: list[ReplicaState], now: float, fresh: dict[str, bool],
               prefill_busy_tokens: int) -> ReplicaState: ...


class RoundRobinRouter:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, adm, candidates, now, fresh, prefill_busy_tokens):
        return candidates[next(self._turn) % len(candidates)]


class LeastLoadedRouter:
    """Lowest projected KV usage plus prefill backlog (as a fraction of the busy threshold)."""

    name = "least-loaded"

    def choose(self, adm, candidates, now, fresh, prefill_busy_tokens):
        return min(candidates, key=lambda r: r.projected_usage(now, fresh[r.name])
                   + r.queued_prefill_tokens / prefill_busy_tokens)


class _Indexed:
    """Keeps an approximate prefix index per replica, fed with what this router sent."""

    def __init__(self) -> None:
        self.indices: dict[str, ApproxPrefixIndex] = {}

    def index(self, r: ReplicaState) -> ApproxPrefixIndex:
        idx = self.indices.get(r.name)
        if idx is None:
            idx = self.indices[r.name] = ApproxPrefixIndex(r.capacity_blocks or DEFAULT_INDEX_BLOCKS)
        elif r.capacity_blocks and idx.capacity != r.capacity_blocks:
            idx.capacity = r.capacity_blocks
        return idx


class LlmdScorerRouter(_Indexed):
    """llm-d's scheduling profile: weighted scorers, max score wins. Weights from llm-d's sample
    EndpointPickerConfig (queue-scorer 1, kv-cache-scorer 1, prefix-cache-scorer 3); prefix score
    = matched blocks / prompt blocks (matchLengthWeight 0); kv score = 1 - KV usage; queue score
    min-max normalised over candidates."""

    name = "llmd-scorers"
    W_QUEUE, W_KV, W_PREFIX = 1.0, 1.0, 3.0

    def choose(self, adm, candidates, now, fresh, prefill_busy_tokens):
        digests = adm.info.block_digests
        queues = [r.queue_depth(fresh[r.name]) for r in candidates]
        qmin, qmax = min(queues), max(queues)
        best, best_score = candidates[0], -1.0
        for r, q in zip(candidates, queues, strict=True):
            prefix = self.index(r).match(digests) / len(digests) if digests else 0.0
            kv = 1.0 - min(1.0, r.projected_usage(now, fresh[r.name]))
            queue = 1.0 if qmax == qmin else 1.0 - (q - qmin) / (qmax - qmin)
            score = self.W_PREFIX * prefix + self.W_KV * kv + self.W_QUEUE * queue
            if score > best_score:
                best, best_score = r, score
        self.index(best).record(digests)
        return best


class PrefixAwareRouter(_Indexed):
    """Bouncer's router: the replica where this request's first token comes soonest, estimated
    as the prefill work queued there plus this prompt's uncached tokens, with free KV as the
    tie-breaker, so a warm prefix wins unless its replica is backed up."""

    name = "prefix-aware"

    def choose(self, adm, candidates, now, fresh, prefill_busy_tokens):
        digests = adm.info.block_digests
        prompt = adm.info.prompt_tokens
        best, best_cost = candidates[0], float("inf")
        for r in candidates:
            cached = self.index(r).match(digests) * r.block_size
            cost = (r.queued_prefill_tokens + max(0, prompt - cached)) / prefill_busy_tokens \
                + r.projected_usage(now, fresh[r.name])
            if cost < best_cost:
                best, best_cost = r, cost
        self.index(best).record(digests)
        return best


ROUTERS = {"round-robin": RoundRobinRouter, "least-loaded": LeastLoadedRouter, "llmd-scorers": LlmdScorerRouter,
           "prefix-aware": PrefixAwareRouter}


def make_router(name: str) -> Router:
    try:
        return ROUTERS[name]()
    except KeyError:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(sorted(ROUTERS))}") from None
