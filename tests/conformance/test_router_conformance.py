"""Every registered router passes the contract its interface states (`bouncer.core.fleet.routing.Router`):
it chooses one of the replicas it was offered (a candidate, or a backlogged one it judges worth
the wait), never another, and changes nothing it was handed. A router registered in
`bouncer.core.registry` is picked up here by name."""

from __future__ import annotations

import copy
import math
import random

import pytest

from bouncer.core import registry
from bouncer.core.fleet.blocks import chain_block_hashes
from bouncer.core.fleet.permits import LocalPermits
from bouncer.core.fleet.pool import PoolView
from bouncer.core.fleet.replica import ReplicaState, Telemetry
from bouncer.core.fleet.routing import cached_tokens
from bouncer.core.flow.dispatch import blocks_and_prefill
from bouncer.core.requests import Admission, RequestInfo

BLOCK = 16
PROMPTS = [chain_block_hashes(list(range(seed * 10_000, seed * 10_000 + 40 * BLOCK))) for seed in range(4)]


def fleet(rng: random.Random, now: float) -> tuple[list[ReplicaState], list[ReplicaState]]:
    """A few replicas in random states (load, freshness, cached prefixes), split into candidates
    and backlogged ones; at least one candidate."""
    replicas = []
    for i in range(rng.randint(1, 6)):
        r = ReplicaState(f"r{i}", "m", None, 10_000, BLOCK)
        if rng.random() < 0.8:  # some never scraped
            r.observe(Telemetry(now - rng.random() * 2, rng.random(), rng.randint(0, 64), rng.randint(0, 64)))
        for digests in PROMPTS:
            if rng.random() < 0.4:
                r.prefix.record(digests[: rng.randint(1, len(digests))], now)
        replicas.append(r)
    rng.shuffle(replicas)
    split = rng.randint(1, len(replicas))
    return replicas[:split], replicas[split:]


def admission(rng: random.Random) -> Admission:
    digests = rng.choice(PROMPTS)[: rng.randint(0, 40)]
    prompt = len(digests) * BLOCK + rng.randint(1, 15)
    return Admission(RequestInfo(f"q{rng.random()}", None, "m", prompt, 64, block_digests=digests), "t", 0, 64, 64,
                     0.0, 30.0, None)


@pytest.mark.parametrize("name", registry.names("router"))
class TestRouter:
    def test_chooses_one_of_the_replicas_it_was_offered_and_changes_nothing_it_was_handed(self, name):
        router = registry.make_router(name)
        rng = random.Random(name)
        for step in range(300):
            now = 100.0 + step
            candidates, backlogged = fleet(rng, now)
            adm = admission(rng)
            everyone = {r.name: r for r in [*candidates, *backlogged]}
            cached = {n: cached_tokens(r, adm, now) for n, r in everyone.items()}
            given = (list(candidates), list(backlogged), dict(cached))
            digests = copy.copy(adm.info.block_digests)
            chosen = router.choose(adm, candidates, PoolView(everyone, None, now), 16384, backlogged, cached)
            assert any(chosen is r for r in [*candidates, *backlogged]), (step, chosen.name)
            assert (candidates, backlogged, cached) == given
            assert adm.info.block_digests == digests

    def test_a_lone_candidate_with_nothing_backlogged_is_chosen(self, name):
        router = registry.make_router(name)
        rng = random.Random(f"{name}-lone")
        for step in range(50):
            now = 10.0 + step
            candidates, _ = fleet(rng, now)
            only = candidates[0]
            adm = admission(rng)
            chosen = router.choose(adm, [only], PoolView({only.name: only}, None, now), 16384, [],
                                   {only.name: cached_tokens(only, adm, now)})
            assert chosen is only

    def test_among_replicas_alike_it_uses_more_than_one(self, name):
        """Fresh, idle, empty replicas, each pick counted as dispatched there: no router sends
        everything to one replica of several alike."""
        router = registry.make_router(name)
        replicas = [ReplicaState(f"r{i}", "m", None, 10_000, BLOCK) for i in range(3)]
        view = PoolView({r.name: r for r in replicas}, None, 0.0)
        rng = random.Random(f"{name}-alike")
        permits = LocalPermits()
        chosen = set()
        for _ in range(30):
            adm = admission(rng)
            cached = {x.name: 0 for x in replicas}
            r = router.choose(adm, list(replicas), view, 16384, [], cached)
            blocks_and_prefill(adm, r, cached)  # dispatched there, as the core counts it
            permits.grant(adm, r, 0.0, math.inf)
            chosen.add(r.name)
        assert len(chosen) > 1
