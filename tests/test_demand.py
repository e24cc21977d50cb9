"""The demand signal for autoscalers (`bouncer.core.fleet.demand`): its formula on known traffic,
what it counts (refusals yes, retries no, sheddable bands apart), and, in the simulator, that N
replicas' worth of load reads N replicas."""

from __future__ import annotations

import math
import random

import pytest

from bouncer.bench.demand_signal import WITHIN, measure
from bouncer.core.fleet.demand import Demand
from bouncer.core.learning.step_time import StepTimeModel
from bouncer.core.model_state import WAITING_FLOOR
from core_helpers import dispatched, info, make_core, observe_idle, rejected, tenant

STEP = StepTimeModel(a=0.01, b=3e-5, c=5e-8, max_batched_tokens=8192, d=1e-9)


def _steady(d: Demand, rate: float, prompt: int, output: int, until: float, tenant_name: str = "t",
            protected: bool = True, seed: int = 0, cached: int = 0) -> None:
    rng = random.Random(seed)
    t = 0.0
    while t < until:
        d.arrived_first(tenant_name, protected, t)
        d.sized(tenant_name, protected, prompt, t)
        d.completed(tenant_name, protected, output, t)
        d.dispatched(prompt, prompt - cached, t)
        t += rng.expovariate(rate)


def test_reads_the_rate_times_the_cost_of_the_mix():
    """Constant sizes at 50 requests/s: the formula by hand, within the rate's sampling noise."""
    d = Demand(window_s=30)
    _steady(d, 50.0, prompt=1000, output=200, until=300)
    kv_tokens = 100_000
    est = d.estimate(300, STEP, max_num_seqs=256, kv_tokens=kv_tokens, tpot_s=None, default_output=512)
    p, o = 1000, 200
    batch = min(256, kv_tokens / (p + o / 2))  # each holds p + o/2 over its decode
    cost = STEP.a * o / batch + STEP.b * (p + o) + STEP.c * (p + o / 2) * o + STEP.d * p * p / 2
    assert est.batch == pytest.approx(batch)
    assert est.cost_s == pytest.approx(cost)
    assert est.offered_rps == pytest.approx(50, rel=0.15)
    assert est.replicas == pytest.approx(est.offered_rps * cost)
    assert est.prompt_tokens == pytest.approx(p) and est.output_tokens == pytest.approx(o)


def test_the_tpot_slo_and_the_batch_cap_shrink_the_batch_and_raise_the_cost():
    d = Demand(window_s=30)
    _steady(d, 20.0, prompt=500, output=300, until=120)
    free = d.estimate(120, STEP, 1024, None, None, 512)
    capped = d.estimate(120, STEP, 64, None, None, 512)
    tight = d.estimate(120, STEP, 1024, None, tpot_s=0.02, default_output=512)
    assert free.batch == 1024 and capped.batch == 64
    held = 500 + 300 / 2
    assert tight.batch == pytest.approx((0.02 - STEP.a) / (STEP.b * (1 + 500 / 300) + STEP.c * held))
    assert free.replicas < capped.replicas and free.replicas < tight.replicas


def test_prefix_hits_take_their_prefill_off_the_cost():
    cold, warm = Demand(30), Demand(30)
    _steady(cold, 10.0, prompt=4000, output=100, until=120)
    _steady(warm, 10.0, prompt=4000, output=100, until=120, cached=3000)  # three quarters found cached
    a = cold.estimate(120, STEP, 256, None, None, 512)
    b = warm.estimate(120, STEP, 256, None, None, 512)
    assert b.prefix_hit_rate == pytest.approx(0.75) and a.prefix_hit_rate == 0
    saved = STEP.b * 0.75 * 4000 + STEP.d * 0.75 ** 2 * 4000 ** 2 / 2  # no prefill for the cached
    assert a.cost_s - b.cost_s == pytest.approx(saved)


def test_a_tenant_refused_at_the_door_is_priced_at_its_own_requests():
    """A flooding tenant of short requests, mostly turned away before its prompts are counted,
    is demand at its own size, not at the size of the requests that got in."""
    d = Demand(window_s=30)
    _steady(d, 10.0, prompt=2000, output=500, until=100, tenant_name="big", seed=1)
    rng = random.Random(2)
    t, n = 0.0, 0
    while t < 100:
        d.arrived_first("flood", True, t)
        if n % 20 == 0:  # one in twenty tokenized and served
            d.sized("flood", True, 100, t)
            d.completed("flood", True, 10, t)
        n += 1
        t += rng.expovariate(200.0)
    est = d.estimate(100, STEP, 256, None, None, 512)
    flood_share = 200 / 210
    assert est.prompt_tokens == pytest.approx(flood_share * 100 + (1 - flood_share) * 2000, rel=0.1)
    assert est.output_tokens == pytest.approx(flood_share * 10 + (1 - flood_share) * 500, rel=0.1)


def test_before_any_answer_the_default_output_prices_it_and_a_single_arrival_reads_above_zero():
    """Scale from zero: nothing served yet, and the first request alone asks for a replica."""
    d = Demand(window_s=30)
    assert d.estimate(0, STEP, 256, None, None, 512).replicas == 0
    d.arrived_first("t", True, 10.0)
    d.sized("t", True, 200, 10.0)
    est = d.estimate(10.5, STEP, 256, None, None, 512)
    assert est.output_tokens == 512 and est.replicas > 0 and math.isfinite(est.replicas)


def test_a_request_held_while_the_pool_is_at_zero_asks_for_a_replica_for_as_long_as_it_waits():
    """Scaled to zero: one request held for a replica asks for one (0.5: one at a target of 0.5
    to 1 per replica), not for the sliver of a replica its arrival rate is worth (an autoscaler
    polling every 15 s must not miss it)."""
    core = make_core(replicas=1, model={"hold_without_replicas_s": 120}, tenants=[tenant("a"), tenant("low", -1)])
    core.set_backends(core.config.models[0].with_backends([]), 0.0)
    assert core.snapshot(0.0)["models"]["m"]["demand"]["all"]["replicas"] == 0
    assert not core.offer(info("low", prompt=100), now=0.0)  # held, a sheddable band too
    demand = core.snapshot(1.0)["models"]["m"]["demand"]
    assert demand["all"]["replicas"] == WAITING_FLOOR and demand["protected"]["replicas"] == 0
    assert not core.offer(info("a", prompt=100), now=1.0)  # held
    for t in (2.0, 60.0, 120.0):
        demand = core.snapshot(t)["models"]["m"]["demand"]
        assert demand["all"]["replicas"] == demand["protected"]["replicas"] == WAITING_FLOOR
    assert len(rejected(core.tick(122.0))) == 2  # past their holds: refused, and nothing waits
    assert core.snapshot(122.0)["models"]["m"]["demand"]["all"]["replicas"] < 0.1


def test_a_sheddable_request_held_at_zero_goes_when_a_replica_answers():
    """A batch job sent to a pool scaled to zero is held like the rest (not refused as
    saturated: no replica, no saturation to judge), and sent once a replica answers."""
    core = make_core(replicas=1, model={"hold_without_replicas_s": 120}, tenants=[tenant("a"), tenant("low", -1)])
    model = core.config.models[0]
    core.set_backends(model.with_backends([]), 0.0)
    assert not core.offer(info("low", prompt=100), now=0.0)
    core.set_backends(model, 30.0)  # a replica came up
    sent = dispatched(observe_idle(core, 30.0) + core.tick(30.0))
    assert [d.tenant for d in sent] == ["low"]


def test_the_signal_decays_when_traffic_stops_and_forgets_quiet_tenants():
    d = Demand(window_s=30)
    _steady(d, 20.0, prompt=500, output=100, until=100)
    busy = d.estimate(100, STEP, 256, None, None, 512).replicas
    later = d.estimate(130, STEP, 256, None, None, 512).replicas
    assert later == pytest.approx(busy * math.exp(-1), rel=0.05)
    assert d.estimate(1000, STEP, 256, None, None, 512).replicas == 0 and not d.flows


def test_the_core_counts_refusals_once_and_retries_not_at_all_and_sheddable_bands_apart():
    """Through the core: a tenant over its rate limit still counts, a retry does not, and a
    sheddable tenant is in `all` but not in `protected`."""
    limited = tenant("a", rate_limit={"requests_per_s": 1, "request_burst": 2})
    core = make_core(tenants=[limited, tenant("low", priority=-1)], replicas=1)
    refused = 0
    for i in range(30):
        refused += len(rejected(core.offer(info("a", prompt=400), now=i * 0.1)))
        core.offer(info("a", prompt=400, retry_count=1, prompt_digest=i), now=i * 0.1 + 0.05)
        core.offer(info("low", prompt=400), now=i * 0.1 + 0.01)
    assert refused >= 20
    demand = core.snapshot(3.0)["models"]["m"]["demand"]
    first_attempts = 60 / 3.0  # of a's and low's, none of the retries
    assert demand["all"]["offered_rps"] == pytest.approx(first_attempts, rel=0.1)
    assert demand["protected"]["offered_rps"] == pytest.approx(first_attempts / 2, rel=0.1)
    assert 0 < demand["protected"]["replicas"] < demand["all"]["replicas"]


@pytest.mark.parametrize("load", [1, 2, 3])
def test_in_the_simulator_n_replicas_worth_of_steady_load_reads_n_replicas(load):
    """One replica offered 1x, 2x, 3x its capacity (most of it refused past 1x): the reading
    averages within 15% of the load (`bouncer bench demand`; docs/benchmarks/autoscaling.md)."""
    r = measure("surge", load, "steady", duration_s=300.0)
    assert abs(r["ratio"] - 1) <= WITHIN, r
    assert r["samples_within"] >= 0.6, r
