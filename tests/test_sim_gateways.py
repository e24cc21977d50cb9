"""Several gateways in the fleet simulator (`bouncer.sim.several_gateways`): sharing against not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bouncer.bench.goodput import run
from bouncer.sim.several_gateways import GatewaySetup


def surge(setup: GatewaySetup) -> dict:
    return run("surge", "bouncer", 2.0, seed=0, replicas=4, duration_s=40.0, gateways=setup)


@pytest.fixture(scope="module")
def three_ways() -> dict[str, dict]:
    return {"one": surge(GatewaySetup()), "independent": surge(GatewaySetup(3)),
            "shared": surge(GatewaySetup(3, delay_s=0.002))}


def test_every_request_ends_once_whatever_the_gateways(three_ways):
    for result in three_ways.values():
        assert result["lost"] == 0
    assert three_ways["shared"]["gateways"] == {"count": 3, "shared": True, "state_delay_ms": 2.0,
                                                "spread": "request"}
    assert "gateways" not in three_ways["one"]


def test_a_retry_at_another_gateway_keeps_its_first_deadline_only_when_they_share(three_ways):
    """Independent gateways know no retry they did not see first: it gets a fresh deadline, and
    is served after its user's. Shared, the ledger knows it anywhere."""
    late = {k: r["tenants"]["standard"]["slo_misses"]["late_ttft_on_retry"] for k, r in three_ways.items()}
    assert late["independent"] > 10 * max(1, late["shared"]), late
    assert late["shared"] <= 2 * max(1, late["one"]) + 5, late


def test_sharing_the_fleets_load_serves_more_within_slo_than_independent_gateways(three_ways):
    good = {k: r["goodput_rps"] for k, r in three_ways.items()}
    assert good["shared"] > good["independent"], good


def test_spread_by_tenant_with_one_tenant_is_one_gateway():
    """Every request on one gateway, the two others idle: the same decisions as one gateway,
    but for when ticks fall (the others' syncs wake the loop)."""
    one = surge(GatewaySetup())
    pinned = surge(GatewaySetup(3, delay_s=0.002, spread="tenant"))
    assert pinned["goodput_rps"] == pytest.approx(one["goodput_rps"], rel=0.02)


def test_the_cli_refuses_what_it_cannot_run():
    def bench(*args):
        return subprocess.run([sys.executable, "-m", "bouncer", "bench", "run", "--scenario", "surge", *args],
                              capture_output=True, text=True, timeout=60)

    out = bench("--policy", "bouncer", "--state-delay-ms", "5")
    assert out.returncode != 0 and "need --gateways 2 or more" in out.stderr
    out = bench("--policy", "vllm-queue-cap", "--gateways", "3")
    assert out.returncode != 0 and "has none" in out.stderr


def test_the_live_benchmarks_shares_count_the_tokens_served_within_the_window():
    from bouncer.bench.gateways_contention import band_shares
    from bouncer.sim.fleet import SimRequest

    def req(tenant, prompt, output, first_token, finished, outcome="completed"):
        return SimRequest(rid=f"{tenant}{first_token}-{finished}", tenant=tenant, priority=0, arrival=0.0,
                          prompt_len=prompt, output_len=output, max_tokens=output, block_digests=[], ttft_slo=None,
                          tpot_slo=None, timeout_s=60, max_retries=0, first_token_at=first_token,
                          finished_at=finished, outcome=outcome)

    requests = [
        req("steady", 90, 10, 25.0, 25.0),  # all of it in the window: 100
        req("bursty", 200, 100, 10.0, 30.0),  # its prompt before; half its answer within: 50
        req("bursty", 300, 200, 35.0, 55.0),  # its prompt and a quarter of its answer within: 350
        req("bursty", 1000, 0, 5.0, 5.0),  # before the window
        req("bursty", 1000, 0, 30.0, 30.0, outcome="refused"),  # not served
        req("top", 1000, 0, 30.0, 30.0),  # not one of the two
    ]
    assert band_shares(requests, ("steady", "bursty"), 20.0, 40.0) == {"steady": 0.2, "bursty": 0.8}
