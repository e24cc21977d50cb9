"""Policies by name: the one table from the names a config uses to the objects that implement them.

`policy.fairness`, `policy.ordering`, `policy.saturation.detector` and `policy.routing.router`
name an entry here. The names a config accepts are `bouncer.config`'s (`FairnessName` and the
others: the config is the contract with the user, and it imports nothing of the core); this table
must implement exactly those, which it checks when imported. A new policy is one class, its name
in the config's list and one line here, plus a page under docs/policies/ and the conformance
suite it must pass (tests/conformance/).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import get_args

from bouncer.config import FairnessName, OrderingName, Policy, RouterName, Routing, SaturationDetectorName
from bouncer.core.fleet.routing import (
    LeastLoadedRouter,
    LlmdScorerRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    Router,
    SglangCacheAwareRouter,
)
from bouncer.core.flow.fairness import CreditStore, RoundRobin, WeightedDeficitRoundRobin
from bouncer.core.flow.ordering import FCFS, EarliestDeadline, OrderingPolicy
from bouncer.core.flow.queues import FairnessPolicy
from bouncer.core.flow.saturation import SaturationDetector, UtilizationDetector

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
CONFIG_NAMES = {"fairness": FairnessName, "ordering": OrderingName, "saturation detector": SaturationDetectorName,
                "router": RouterName}


def unmatched_names() -> list[str]:
    """Each kind whose table and config names differ, with the difference; empty when they agree."""
    out = []
    for kind, table in KINDS.items():
        named = set(get_args(CONFIG_NAMES[kind]))
        if named != set(table):
            out.append(f"{kind}: the config names {sorted(named - set(table))} with no implementation here, "
                       f"and this table implements {sorted(set(table) - named)} the config does not accept")
    return out


_UNMATCHED = unmatched_names()
if _UNMATCHED:  # a name the config accepts and nothing implements would fail only at reload
    raise ImportError("bouncer.core.registry and bouncer.config disagree: " + "; ".join(_UNMATCHED))


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
