"""Choosing a replica for an admitted request, among those admission found eligible.

A router only ranks candidates the core has already filtered (not busy, fresh or fail-open,
room for the request's KV). When none is eligible, routing defers to admission, which holds the
request. Routers are chosen by name in config.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from bouncer.core.fleet import ReplicaState
from bouncer.core.requests import Admission


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


ROUTERS = {"round-robin": RoundRobinRouter, "least-loaded": LeastLoadedRouter}


def make_router(name: str) -> Router:
    try:
        return ROUTERS[name]()
    except KeyError:
        raise ValueError(f"unknown router {name!r}; known: {', '.join(sorted(ROUTERS))}") from None
