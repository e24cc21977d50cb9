"""`bouncer bench run` / `report`: the result file's contract and the report it feeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bouncer.bench import goodput

REQUIRED = {"scenario", "policy", "load", "seed", "replicas", "sim_seconds", "wall_seconds", "offered", "lost",
            "outcomes", "refused_by_reason", "goodput_rps", "goodput_tokens_per_s", "goodput_prompt_tokens_per_s",
            "throughput_tokens_per_s",
            "prefix_hit_rate", "preemptions", "wasted_tokens", "tenants"}
TENANT_KEYS = {"priority", "offered", "slo_attainment", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s",
               "served_token_share", "weight"}


@pytest.fixture(autouse=True)
def capacity_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(goodput, "CACHE_DIR", tmp_path / "capacity")


def test_result_json_has_the_agreed_keys_and_loses_nothing(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "run", "--scenario", "rogue-tenant", "--policy",
                           "bouncer", "--load", "2", "--duration", "20", "--replicas", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "BOUNCER_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert REQUIRED <= set(r)
    assert r["lost"] == 0 and sum(r["outcomes"].values()) == r["offered"] > 0
    assert set(r["tenants"]) == {"sla", "research", "free"}
    for t in r["tenants"].values():
        assert TENANT_KEYS <= set(t)
        # every request outside goodput has one stated reason
        assert round(t["slo_attainment"] * t["offered"]) + sum(t["slo_misses"].values()) == t["offered"]
    assert abs(sum(t["served_token_share"] for t in r["tenants"].values()) - 1.0) < 1e-9


def test_set_changes_a_policy_setting_for_one_run(tmp_path):
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "run", "--scenario", "surge", "--policy",
                           "bouncer", "--load", "3", "--duration", "20", "--replicas", "1",
                           "--set", "retries.deadline=first-attempt", "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "BOUNCER_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["policy_set"] == {"retries": {"deadline": "first-attempt"}}
    # the setting took effect: late retries were refused as such, which only it does
    assert r["refused_by_reason"].get("slo/retry_past_deadline", 0) > 0 and r["lost"] == 0
    with pytest.raises(ValueError, match="policy settings apply"):
        goodput.run("surge", "tgi-cap", 1.0, duration_s=5, replicas=1, policy_set={"retries": {}})


def test_only_tenants_replays_the_same_arrivals_of_one_band_alone():
    mix = goodput.run("consolidation", "none", 2.0, duration_s=20, replicas=1)
    alone = goodput.run("consolidation", "none", 2.0, duration_s=20, replicas=1, only_tenants=["realtime"])
    assert alone["capacity_rps"] == mix["capacity_rps"]  # load still counts the whole mix
    assert set(alone["tenants"]) == {"realtime"} and alone["only_tenants"] == ["realtime"]
    assert alone["offered"] == alone["tenants"]["realtime"]["offered"] == mix["tenants"]["realtime"]["offered"] > 0
    assert alone["lost"] == 0
    # without the standard band's work in the engines, the realtime band does at least as well
    assert alone["tenants"]["realtime"]["slo_attainment"] >= mix["tenants"]["realtime"]["slo_attainment"]
    with pytest.raises(ValueError, match="unknown tenant"):
        goodput.run("consolidation", "none", 2.0, duration_s=5, replicas=1, only_tenants=["nobody"])


def test_bouncer_keeps_goodput_where_no_admission_collapses():
    none = goodput.run("surge", "none", 2.0, duration_s=30, replicas=1)
    bouncer = goodput.run("surge", "bouncer", 2.0, duration_s=30, replicas=1)
    assert none["lost"] == bouncer["lost"] == 0
    assert bouncer["goodput_rps"] > 2 * none["goodput_rps"]


def test_the_flood_keeps_the_top_tenant_where_no_admission_drowns_it():
    """The live guidellm flood as a simulator scenario: a sheddable tenant of synthetic requests
    at a constant rate, the top tenant beside it."""
    runs = {p: goodput.run("flood", p, 2.0, duration_s=30, replicas=1) for p in ("none", "bouncer")}
    for r in runs.values():
        assert r["lost"] == 0 and {t: v["priority"] for t, v in r["tenants"].items()} == {"top": 10, "flood": -1}
    assert runs["bouncer"]["tenants"]["top"]["slo_attainment"] == 1.0
    assert runs["none"]["tenants"]["top"]["slo_attainment"] < 0.5
    assert runs["bouncer"]["goodput_rps"] > 2 * runs["none"]["goodput_rps"]


def test_the_flood_replays_no_trace():
    with pytest.raises(ValueError, match="synthetic"):
        goodput.run("flood", "bouncer", 1.0, duration_s=10, replicas=1, trace="data/traces/azure-2023")


def test_report_writes_markdown_and_plots(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for policy in ("none", "bouncer"):
        for load in (1.0, 2.0):
            goodput.save(goodput.run("surge", policy, load, duration_s=15, replicas=1),
                         str(results / f"surge-{policy}-{load}.json"))
    # a measurement saved beside the runs (as scripts/servegen_wall_ratio.py saves its own) is skipped, and said so
    (results / "wall-ratio.json").write_text(json.dumps({"load": 3.0, "rounds": []}))
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "report", str(results), "--out",
                           str(tmp_path / "report")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "skipped" in proc.stderr and "wall-ratio.json" in proc.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## surge" in md and "| bouncer |" in md and "| none |" in md
    # goodput in prompt tokens, as the runs counted it (thousands a second, two decimals)
    r = json.loads((results / "surge-bouncer-2.0.json").read_text())
    assert 0 < r["goodput_prompt_tokens_per_s"] and "The same in prompt tokens" in md
    assert f"{r['goodput_prompt_tokens_per_s'] / 1000:.2f}" in md.split("The same in prompt tokens")[1]
    for png in ("goodput-vs-load.png", "tenant-slo.png", "timeline-surge.png"):
        assert (tmp_path / "report" / png).stat().st_size > 10_000


def test_prefix_scenario_compares_routers_against_the_infinite_cache_bound(tmp_path):
    """Mooncake conversations on 4 replicas: the prefix-aware router keeps conversations where
    their prefix is cached, round-robin scatters them; the report tabulates both."""
    runs = {name: goodput.run("prefix", "bouncer", 0.8, duration_s=60, replicas=4, routing=name)
            for name in ("round-robin", "prefix-aware")}
    for name, r in runs.items():
        assert r["routing"] == name and r["lost"] == 0
        assert {"prefix_hit_rate", "prefix_hit_bound", "kv_imbalance", "ttft_p50_s", "ttft_p99_s"} <= set(r)
        assert 0 < r["prefix_hit_rate"] <= r["prefix_hit_bound"] < 1
    assert runs["prefix-aware"]["prefix_hit_rate"] > 1.3 * runs["round-robin"]["prefix_hit_rate"]
    for name, r in runs.items():
        goodput.save(r, str(tmp_path / "results" / f"{name}.json"))
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "report", str(tmp_path / "results"), "--out",
                           str(tmp_path / "report")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "report" / "report.md").read_text()
    assert "## prefix: routers" in md and "| 0.8 | bouncer | prefix-aware |" in md
    assert "| 0.8 | bouncer | round-robin |" in md


def test_report_refuses_a_file_that_is_not_a_run(tmp_path):
    from bouncer.bench.report import load_results

    side = tmp_path / "wall-ratio.json"
    side.write_text(json.dumps({"load": 3.0, "rounds": []}))
    with pytest.raises(SystemExit, match="not a `bouncer bench run` result"):
        load_results([str(side)])
    assert load_results([str(tmp_path)]) == []


def test_report_groups_many_tenants_by_band():
    from bouncer.bench.report import tenant_groups, tenant_table

    def tenant(prio, offered, att, p99, share):
        return {"priority": prio, "offered": offered, "slo_attainment": att, "ttft_p99_s": p99,
                "served_token_share": share}

    tenants = {f"light-{i}": tenant(1, 10, 1.0, 0.5 + i, 0.05) for i in range(6)}
    tenants |= {"heavy-a": tenant(0, 100, 0.5, 2.0, 0.5), "heavy-b": tenant(0, 300, 0.1, 9.0, 0.2)}
    result = {"scenario": "surge", "load": 3.0, "policy": "bouncer", "tenants": tenants}
    groups = tenant_groups(result)
    assert list(groups) == ["band 1 (6 tenants)", "band 0 (2 tenants)"]
    heavy = groups["band 0 (2 tenants)"]
    assert heavy["slo_attainment"] == (0.5 * 100 + 0.1 * 300) / 400  # over all the band's requests
    assert heavy["ttft_p99_s"] == 9.0 and heavy["served_token_share"] == pytest.approx(0.7)
    assert groups["band 1 (6 tenants)"]["offered"] == 60
    assert "band 0 (2 tenants) SLO att." in tenant_table([result], "surge", 3.0)[0]
    few = {"scenario": "surge", "load": 3.0, "policy": "bouncer", "tenants": dict(list(tenants.items())[:3])}
    assert tenant_groups(few) == few["tenants"]  # a handful of tenants are shown one by one


def test_retry_after_is_checked_against_what_happened_and_holds_within_2x():
    """Issue #16: Retry-After told clients when to come back; the simulator measures, per refusal
    reason, the ratio of what it said to the time until a request of that tenant sent after the
    refusal was admitted. Before, a queue-TTL refusal said up to 60 s on a backlog gone in 18."""
    from bouncer.bench.goodput import retry_after_accuracy, simulate
    _, _, _, result = simulate("surge", "bouncer", 3.0, seed=0, replicas=2, duration_s=60)
    accuracy = retry_after_accuracy(result)
    judged = {reason: a for reason, a in accuracy.items() if a["refusals"] >= 50}
    assert "slo/deadline_infeasible" in judged and "flow/ttl_expired" in judged, accuracy
    for reason, a in judged.items():
        assert 0.5 <= a["median_ratio"] <= 2.0, (reason, a)
