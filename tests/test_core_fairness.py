"""Fairness inside a band: a tenant that sends 10x more gets no more than its weight."""

from __future__ import annotations

import random

import pytest

from bouncer.core.outcomes import Terminal
from core_helpers import admission_of, dispatched, info, make_core, tenant


def contend(fairness: str, weights: dict[str, float], offers: dict[str, tuple[int, int]], steps: int = 300):
    """Each step every tenant offers `count` requests of `prompt` tokens; the replica runs 4 at a
    time and all finish by the next step. Returns each tenant's share of dispatched tokens."""
    core = make_core(tenants=[tenant(n, weight=w) for n, w in weights.items()], replicas=1, kv_blocks=10**6,
                     policy={"fairness": fairness, "max_inflight_per_replica": 4, "default_ttl_s": 1e9,
                             "queues": {"tenant_max_requests": 100000, "max_requests": 100000,
                                        "band_max_requests": 100000, "tenant_max_tokens": 10**9,
                                        "max_tokens": 10**10},
                             "telemetry": {"staleness_s": 1e9}})
    served = {n: 0 for n in weights}
    inflight = []
    for step in range(steps):
        now = float(step)
        for name, (count, prompt) in offers.items():
            for _ in range(count):
                for d in dispatched(core.offer(info(name, prompt=prompt, max_tokens=10), now)):
                    inflight.append(d)
        done, inflight = inflight, []
        for d in done:
            served[d.tenant] += admission_of(core, d).cost_tokens
            inflight += dispatched(core.finished(d.request_id, now + 0.5, Terminal.COMPLETED, 10))
    total = sum(served.values())
    return {n: s / total for n, s in served.items()}


@pytest.mark.parametrize("fairness", ["wdrr", "round-robin"])
def test_heavy_tenant_gets_no_more_than_its_weight(fairness):
    shares = contend(fairness, {"heavy": 1.0, "light": 1.0}, {"heavy": (30, 100), "light": (3, 100)})
    assert shares["heavy"] == pytest.approx(0.5, abs=0.05)


def test_wdrr_shares_follow_weights():
    shares = contend("wdrr", {"gold": 3.0, "bronze": 1.0}, {"gold": (10, 100), "bronze": (30, 100)})
    assert shares["gold"] == pytest.approx(0.75, abs=0.05)


def test_wdrr_counts_tokens_so_long_prompts_cannot_crowd_out_short_chats():
    # "long" sends 10x the tokens per request; round-robin in turns would give it ~10x the tokens
    wdrr = contend("wdrr", {"long": 1.0, "chat": 1.0}, {"long": (10, 2000), "chat": (10, 200)})
    rr = contend("round-robin", {"long": 1.0, "chat": 1.0}, {"long": (10, 2000), "chat": (10, 200)})
    assert wdrr["long"] == pytest.approx(0.5, abs=0.05)
    assert rr["long"] > 0.85


def _room_bound_shares(fair_hold_s: float, steps: int = 400) -> dict[str, float]:
    """One replica whose KV holds about 45 small requests or 4 big ones. Each request runs for
    10 to 30 steps, so room frees a little at a time; both tenants keep a backlog queued. Each
    tenant's share of the tokens dispatched."""
    lives = random.Random(0)
    core = make_core(tenants=[tenant("big"), tenant("small")], replicas=1, kv_blocks=700,
                     policy={"fair_hold_s": fair_hold_s, "default_ttl_s": 1e9, "telemetry": {"staleness_s": 1e9},
                             "queues": {"tenant_max_requests": 10**5, "max_requests": 10**5,
                                        "band_max_requests": 10**5, "tenant_max_tokens": 10**9,
                                        "max_tokens": 10**10}})
    flow = core.models["m"].flow
    served = {"big": 0, "small": 0}
    ends: dict[int, list] = {}

    def run(events, step):
        for d in dispatched(events):
            served[d.tenant] += admission_of(core, d).cost_tokens
            ends.setdefault(step + lives.randint(10, 30), []).append(d)

    for step in range(steps):
        now = step * 0.01
        for d in ends.pop(step, []):
            run(core.finished(d.request_id, now, Terminal.COMPLETED, 10), step)
        for name, prompt in (("big", 2000), ("small", 200)):
            while (q := flow.queue_of(name, 0)) is None or q.count < 40:
                run(core.offer(info(name, prompt=prompt, max_tokens=10), now), step)
    total = served["big"] + served["small"]
    return {"big": served["big"] / total, "small": served["small"] / total}


def test_a_tenant_whose_head_waits_for_room_holds_it_from_smaller_requests():
    # the small tenant's requests fit each bit of room that frees; the big tenant's head needs
    # ten times as much: held for it, the band's tokens split evenly
    held = _room_bound_shares(fair_hold_s=1e9)
    assert held["big"] == pytest.approx(0.5, abs=0.05)
    # not held (fair_hold_s 0), the small requests take the room as it frees
    unheld = _room_bound_shares(fair_hold_s=0.0)
    assert unheld["big"] < 0.4
