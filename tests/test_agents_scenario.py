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


def test_agents_run_reports_sessions_hit_rate_and_recomputation(tmp_path):
    out = tmp_path / "a.json"
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "run", "--scenario", "agents", "--policy",
                           "bouncer", "--sessions", "6", "--duration", "900", "--replicas", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    for key in ("sessions_completed_per_hour", "recomputed_tokens", "prefix_hit_rate", "prefix_hit_rate_over_time"):
        assert key in r
    assert r["steps_completed"] > 20 and r["prefix_hit_rate"] > 0.5  # steps reuse their own context

    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "report", str(out), "--out", str(report)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    md = (report / "report.md").read_text()
    per_session = "-" if r["steps_per_completed_session"] is None else f"{r['steps_per_completed_session']:.2f}"
    row = (f"| 0.25 | 6 | bouncer | {r['sessions_completed_per_hour']:.1f} | {per_session} | {r['sessions_failed']} "
           f"({r['sessions_failed_midway']}) | {r['sessions_under_way']} |")
    assert "## agents" in md and row in md
    assert (report / "agents-hit-rate.png").stat().st_size > 10_000


def test_request_cap_is_sized_to_the_kv_pool():
    r = agents.run("request-cap", 4, duration_s=120, replicas=1)
    assert 1 <= r["request_cap_per_replica"] <= 10  # ~400k tokens of KV over ~90k-token steps
