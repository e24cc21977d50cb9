"""The gateway-cost benchmarks run end to end, short: real processes, and what they report is
consistent (no timing is asserted: the numbers are for the benchmark's own runs to print)."""

from __future__ import annotations

import pytest

from bouncer.bench import flood, long_prompts

pytestmark = pytest.mark.slow


def test_long_prompts_counts_every_prompt_as_a_full_tokenization_does():
    steps = long_prompts.run(n_sessions=1, steps=2, small_steps=2)
    assert len(steps) == 4 and [s.first for s in steps] == [True, False, False, False]
    assert all(s.counts_match for s in steps)  # both gateways, every request
    assert steps[1].added_tokens > 5_000 and 0 < steps[3].added_tokens < 2_000
    assert all(s.cpu_ms_cached > 0 and s.cpu_ms_uncached > 0 for s in steps)
    assert "| 0k-30k |" in long_prompts.report(steps)


def test_the_rogue_drill_reports_what_the_flood_got_and_what_the_gateway_spent():
    r = flood.run(clients=40, seconds=4.0)
    assert r["interactive"]["completed"] > 0 and r["interactive"]["ttft_p50_s"] is not None
    answered_by_status = sum(r["flood_by_status"].values()) - r["flood_by_status"].get("error", 0)
    ended = {k: v for k, v in r["gateway_ends"].items() if k.startswith("free ") and "admitted" not in k}
    # the gateway's count of the flood's ends is the clients' (give or take one still being counted)
    assert abs(sum(ended.values()) - answered_by_status) <= 2
    assert r["gateway_cpu_s"] > 0 and r["interactive_in_gateway"]["loop_lag_p99_s_at_most"] is not None
    assert "rogue drill" in flood.report(r)


def test_long_prompts_reports_the_tokenizers_floor_and_the_real_sessions_step_sizes():
    # the floor: the bundled tokenizer's own CPU time for 10k tokens, so the table can be read
    # against what no cache can save (a step's new tokens must be tokenized)
    floor = long_prompts.tokenizer_floor(10_000)
    assert 0.5 < floor < 200
    adds = long_prompts.real_increments(above=100_000)
    assert len(adds) > 100 and adds == sorted(adds) and adds[0] > 0
    # most real steps add little: the table's "~1k" rows are the common case, "~10k" the tail
    assert adds[len(adds) // 2] < 2_000 < adds[int(len(adds) * 0.9)] < 10_000
