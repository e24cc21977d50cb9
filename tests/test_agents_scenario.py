"""The agents scenario: WEKA's Claude Code sessions replayed closed-loop."""

from __future__ import annotations

import json
import subprocess
import sys

from bouncer.bench import agents
from bouncer.sim.scenarios import WEKA_SESSIONS
from bouncer.sim.traces import SessionDigests, load_weka


def test_weka_sessions_load_and_replays_share_prefixes_only_within_themselves():
    sessions = load_weka(WEKA_SESSIONS)
    assert len(sessions) == 61 and all(s.block_tokens == 64 and s.steps for s in sessions)
    s = sessions[0]
    one, two = SessionDigests("a", 64), SessionDigests("b", 64)
    d0, d1 = one.of(s.steps[0], 120_000), one.of(s.steps[1], 120_000)
    assert len(d0) == s.steps[0].prompt_len // 16
    shared = next((i for i, (x, y) in enumerate(zip(d0, d1, strict=False)) if x != y), min(len(d0), len(d1)))
    assert shared > 0.9 * len(d0) and len(d1) > len(d0)  # the next step extends the same context
    assert not set(two.of(s.steps[0], 120_000)) & set(d0)  # another replay of it shares nothing


def _bench_run(policy: str, out) -> dict:
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "run", "--scenario", "agents", "--policy",
                           policy, "--sessions", "6", "--duration", "900", "--replicas", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_agents_run_reports_sessions_hit_rate_and_recomputation(tmp_path):
    r = _bench_run("bouncer", tmp_path / "a.json")
    for key in ("sessions_completed_per_hour", "recomputed_tokens", "prefix_hit_rate", "prefix_hit_rate_over_time"):
        assert key in r
    assert r["steps_completed"] > 20 and r["prefix_hit_rate"] > 0.5  # steps reuse their own context
    cap = _bench_run("request-cap", tmp_path / "c.json")

    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "report", str(tmp_path / "a.json"),
                           str(tmp_path / "c.json"), "--out", str(report)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    md = (report / "report.md").read_text()

    def row(x: dict, against: str) -> str:
        per_session = "-" if x["steps_per_completed_session"] is None else f"{x['steps_per_completed_session']:.2f}"
        return (f"| 0.25 | 6 | 0 | {x['policy']} | {x['sessions_completed_per_hour']:.1f} | {against} | "
                f"{per_session} | "
                f"{x['sessions_failed']} ({x['sessions_failed_midway']}) | {x['steps_of_failed_sessions']} | "
                f"{x['sessions_under_way']} |")
    # each row's sessions/h against the request cap's in the same run length and concurrency
    assert cap["sessions_completed_per_hour"] > 0
    ratio = r["sessions_completed_per_hour"] / cap["sessions_completed_per_hour"]
    assert "## agents" in md and row(cap, "1.00x") in md and row(r, f"{ratio:.2f}x") in md
    assert (report / "agents-hit-rate.png").stat().st_size > 10_000


def test_request_cap_is_sized_to_the_kv_pool():
    r = agents.run("request-cap", 4, duration_s=120, replicas=1)
    assert 1 <= r["request_cap_per_replica"] <= 10  # ~400k tokens of KV over ~90k-token steps
