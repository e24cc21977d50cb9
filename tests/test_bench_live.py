"""`bouncer bench live` (bouncer/bench/live.py): real engine and gateway processes, real clients
(the openai SDK, guidellm), real time, beside the simulator's prediction of the same run."""

from __future__ import annotations

import os
import pathlib

import pytest

from bouncer.bench import live
from bouncer.sim.fleet import SimRequest

REPO = pathlib.Path(__file__).resolve().parents[1]
# a relative path in the environment is from the repository
GUIDELLM = REPO / os.environ.get("BOUNCER_GUIDELLM", ".venv-guidellm/bin/guidellm")


def _request(rid: str, digests: list[int], prompt: int) -> SimRequest:
    return SimRequest(rid=rid, tenant="t", priority=0, arrival=0.0, prompt_len=prompt, output_len=8, max_tokens=8,
                      block_digests=digests, ttft_slo=None, tpot_slo=None, timeout_s=60, max_retries=2)


def test_prompts_share_the_blocks_the_trace_shares_and_nothing_else():
    a = live.prompt_ids(_request("a", [11, 12, 13], 60), 16)
    b = live.prompt_ids(_request("b", [11, 12, 99], 60), 16)
    c = live.prompt_ids(_request("c", [], 60), 16)
    assert len(a) == len(b) == len(c) == 60
    assert a[:32] == b[:32] and a[32:48] != b[32:48]  # two shared blocks, then their own
    assert a[:16] != c[:16]
    lo, hi = live.TOKEN_IDS
    assert all(lo <= t < hi for t in a + b + c)


def test_a_warm_up_is_sent_but_not_counted():
    scenario = live.get_scenario("surge", 100.0)
    done = []
    for i in range(100):  # one request a second, each served at once
        r = SimRequest(rid=f"r{i}", tenant="standard", priority=0, arrival=float(i), prompt_len=10, output_len=2,
                       max_tokens=2, block_digests=[], ttft_slo=2.0, tpot_slo=0.1, timeout_s=60, max_retries=0)
        r.outcome, r.first_token_at, r.finished_at = "completed", i + 0.1, i + 0.15
        done.append(r)
    all_of_it, after = live._table(scenario, done, 100.0), live._table(scenario, done, 100.0, warm_up_s=60.0)
    assert all_of_it["tenants"]["standard"]["offered"] == 100 and all_of_it["goodput_rps"] == pytest.approx(1.0)
    assert after["tenants"]["standard"]["offered"] == 40 and after["goodput_rps"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="warm-up"):
        live.run("surge", 2.0, duration_s=10.0, warm_up_s=10.0)


def test_the_simulated_engines_run_as_slow_as_the_live_ones():
    fleet = live.LiveFleet(speed=0.25, kv_blocks=1024, max_num_seqs=32)
    prof = fleet.sim_profile()
    base = live.engine_profile(fleet.profile)
    assert prof.step_time(100, 1000, 0) == pytest.approx(4 * base.step_time(100, 1000, 0))
    assert (prof.num_blocks, prof.max_num_seqs) == (1024, 32)


def _accounted(result: dict, key: str) -> None:
    """Every request counted has an end, and only one."""
    for name, t in result[key]["tenants"].items():
        assert None not in t["outcomes"] and sum(t["outcomes"].values()) == t["offered"], (key, name, t)


@pytest.mark.slow
def test_a_trace_replayed_live_through_bouncer_and_straight_to_the_engines_beside_the_simulator():
    result = live.run("consolidation", load=1.5, duration_s=20)
    for key in ("live_bouncer", "live_direct", "sim_bouncer", "sim_none"):
        _accounted(result, key)
    lb, sb, direct = result["live_bouncer"], result["sim_bouncer"], result["live_direct"]
    # the top band, live: kept far above what the same requests get straight to the engines
    # (its 50 ms TPOT SLO is close to these 0.25x engines' shortest step, so a loaded machine's
    # per-token delays cost it some: docs/benchmarks/live.md, "Live")
    top, top_direct = lb["tenants"]["realtime"]["slo_attainment"], direct["tenants"]["realtime"]["slo_attainment"]
    assert top >= 0.6 and top >= top_direct + 0.3, live.report(result)
    assert lb["step_time"]["warm"]  # learned from the run's own requests
    # live and simulated agree (bounds loose for a 20 s run on a shared machine; the published
    # runs are longer: docs/benchmarks/live.md, "Live")
    assert 0.75 <= lb["goodput_rps"] / sb["goodput_rps"] <= 1.25, live.report(result)
    assert "live Bouncer" in live.report(result)


@pytest.mark.slow
@pytest.mark.skipif(not GUIDELLM.exists(), reason=f"no guidellm at {GUIDELLM}: `make test` installs it")
def test_guidellm_flooding_at_twice_capacity_with_the_top_tenant_beside_it():
    result = live.run_flood(load=2.0, duration_s=20, guidellm_bin=str(GUIDELLM), skip_direct=True)
    lb, sb = result["live_bouncer"], result["sim_bouncer"]
    for key in ("live_bouncer", "sim_bouncer", "sim_none"):
        _accounted(result, key)
    top = lb["tenants"]["top"]
    # the target is 99% (met in the published runs); one miss is allowed on a shared CI machine
    assert top["slo_attainment"] * top["offered"] >= top["offered"] - 1, live.report(result)
    assert lb["tenants"]["flood"]["outcomes"].get("refused", 0) > 0  # the flood was pushed back
    assert 0.75 <= lb["goodput_rps"] / sb["goodput_rps"] <= 1.25, live.report(result)
