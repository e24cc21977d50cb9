"""scripts/priority_ceiling.py: the upper bound on what a policy that serves higher bands first can
complete (docs/benchmarks/servegen.md, m-mid's section)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from bouncer.sim.profiles import get_profile

_PATH = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "priority_ceiling.py"
_spec = importlib.util.spec_from_file_location("priority_ceiling", _PATH)
ceiling_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ceiling_script)


def _reqs(*costs: float, output: int = 10, prompt: int = 100) -> list[tuple[float, int, int]]:
    return [(c, output, prompt) for c in costs]


def test_the_top_band_is_served_whole_before_a_lower_band_gets_any_engine_time():
    costs = {10: _reqs(1.0, 1.0), 0: _reqs(0.5, 0.5, 3.0)}
    out = ceiling_script.ceiling(costs, engine_s=3.0)
    assert out["bands"][10]["offered"] == 2
    assert all(out["bands"][10][k] == 2 for k in ceiling_script.ORDERS)
    # 1 s left for the lower band: at its mean cost (4/3 s) none fits, cheapest first two do
    assert out["bands"][0]["mean_order"] == 0 and out["bands"][0]["cheapest_first"] == 2
    assert out["mean_order"] == 2 and out["cheapest_first"] == 4
    assert out["output_tokens"]["mean_order"] == 20 + 7  # 1 s of the band's 4 s: a quarter of its 30 tokens
    assert out["output_tokens"]["cheapest_first"] == 40


def test_a_top_band_larger_than_the_engine_time_leaves_nothing_below_it():
    out = ceiling_script.ceiling({1: _reqs(*[1.0] * 10), 0: _reqs(*[0.1] * 10)}, engine_s=4.5)
    assert out["bands"][1]["mean_order"] == 4 and out["bands"][1]["cheapest_first"] == 4
    assert out["bands"][0]["mean_order"] == 0 and out["bands"][0]["cheapest_first"] == 0


def test_everything_fits_when_the_engine_time_covers_every_band():
    out = ceiling_script.ceiling({1: _reqs(1.0), 0: _reqs(2.0, 2.0)}, engine_s=10.0)
    assert all(out[k] == 3 for k in ceiling_script.ORDERS)
    assert all(v == 30 for v in out["output_tokens"].values())


def test_the_lower_band_filled_in_each_order_counts_the_output_tokens_each_serves():
    """1 s left for three requests: a cheap one with a short answer and a long prompt, one with a
    long answer, and one with a short prompt. Each order fits a different one."""
    band = [(0.4, 5, 900), (1.0, 100, 500), (0.9, 20, 50)]
    bands = ceiling_script.ceiling({0: band}, engine_s=1.0)["bands"]
    out = bands[0]["output_tokens"]
    assert out["cheapest_first"] == 5  # 0.4 s, then 0.9 s does not fit
    assert out["shortest_prompt"] == 20  # the 50-token prompt first (0.9 s), then nothing fits
    assert out["most_output"] == 100  # 100 tokens a second beats 22 and 12.5
    assert out["mean_order"] == int(1.0 / 2.3 * 125)
    assert out["offered"] == 125


def test_a_requests_cost_is_the_step_times_per_token_terms_summed_over_its_steps():
    """A prompt computed in one step, which gives the first answer token, then one token a step,
    alone on the engine: the request's cost is those steps' time less their fixed cost `a`."""
    p = get_profile("llama-3.1-8b-h100")
    prompt, output = 300, 5
    steps = p.step_time(prompt, 0, prompt * (prompt + 1) // 2) - p.a
    # the k-th decode step reads the prompt and the k answer tokens before the one it computes
    steps += sum(p.step_time(1, prompt + k) - p.a for k in range(1, output))
    assert ceiling_script.request_cost(p, prompt, output) == pytest.approx(steps, rel=1e-9)
    assert ceiling_script.request_cost(p, prompt, 1) == pytest.approx(
        p.step_time(prompt, 0, prompt * (prompt + 1) // 2) - p.a, rel=1e-9)
