"""Policies by name: the one table from the names a config uses to the objects that implement them.

`policy.fairness`, `policy.ordering`, `policy.saturation.detector` and `policy.routing.router`
name an entry here; the config is validated against these tables (`bouncer.config`), so a name
lives in exactly one place. A new policy is one class and one line here, plus a page under
docs/policies/ and the conformance suite it must pass (tests/conformance/).
"""

from __future__ import annotations

from collections.abc import Callable

from bouncer.config import Policy, Routing
from bouncer.core.fairness import CreditStore, FairnessPolicy, RoundRobin, WeightedDeficitRoundRobin
from bouncer.core.ordering import FCFS, EarliestDeadline, OrderingPolicy
from bouncer.core.routing import (
    LeastLoadedRouter,
    LlmdScorerRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    Router,
    SglangCacheAwareRouter,
)
from bouncer.core.saturation import SaturationDetector, UtilizationDetector

FAIRNESS: dict[str, Callable[[CreditStore, int], FairnessPolicy]] = {
    RoundRobin.name: RoundRobin,
    WeightedDeficitRoundRobin.name: WeightedDeficitRoundRobin,
}
ORDERING: dict[str, Callable[[], OrderingPolicy]] = {FCFS.name: FCFS, EarliestDeadline.name: EarliestDeadline}
SATURATION: dict[str, Callable[[Policy], SaturationDetector]] = {UtilizationDetector.name: UtilizationDetector}
ROUTERS: dict[str, Callable[[Routing | None], Router]] = {
    cls.name: cls for cls in (RoundRobinRouter, LeastLoadedRouter, LlmdScorerRouter, SglangCacheAwareRouter,
                              PrefixAwareRouter)}

KINDS = {"fairness": FAIRNESS, "ordering": ORDERING, "saturation detector": SATURATION, "router": ROUTERS}


def _lookup(kind: str, name: str):
    table = KINDS[kind]
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}") from None


def make_fairness(name: str, credit: CreditStore, quantum_tokens: int) -> FairnessPolicy:
    return _lookup("fairness", name)(credit, quantum_tokens)


def make_ordering(name: str) -> OrderingPolicy:
    return _lookup("ordering", name)()


def make_saturation(name: str, policy: Policy) -> SaturationDetector:
    return _lookup("saturation detector", name)(policy)


def make_router(name: str, cfg: Routing | None = None) -> Router:
    return _lookup("router", name)(cfg)


def names(kind: str) -> list[str]:
    return sorted(KINDS[kind])
