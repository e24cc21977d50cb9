"""The agents scenario: WEKA's Claude Code sessions replayed closed-loop."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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


WEKA_SUBAGENTS = WEKA_SESSIONS.parent / "subagents"


def test_sessions_with_subagents_load_with_each_subagents_timing():
    sessions = {s.name: s for s in load_weka(WEKA_SUBAGENTS)}
    assert len(sessions) == 15 and all(s.subagents for s in sessions.values())
    s = sessions["trace_0003"]  # step 0 ends at 7.27 s; a subagent ran 126.0 s, ending at 134.2 s
    sub = s.subagents[0]
    assert (sub.after_step, sub.waited, len(sub.session.steps)) == (0, True, 10)
    assert sub.offset_s == pytest.approx(134.227 - 126.015 - 7.27)
    assert s.steps[1].after_subagents_s == pytest.approx(153.0 - 134.227)  # after its result came
    # asynchronously launched subagents (no duration) are not waited for
    assert any(not x.waited for x in sessions["trace_0295"].subagents)


def test_a_subagent_entry_nests_and_a_bad_one_is_named(tmp_path):
    trace = {"id": "t", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 100, "out": 10, "hash_ids": [1, 2], "api_time": 1.0},
        {"t": 6.0, "type": "subagent", "duration_ms": 4000, "requests": [
            {"t": 0.0, "type": "n", "in": 50, "out": 5, "hash_ids": [9]},
            {"t": 1.0, "type": "subagent", "duration_ms": 500, "requests": [
                {"t": 0.0, "type": "n", "in": 20, "out": 2, "hash_ids": [11]}]}]},
        {"t": 8.0, "type": "n", "in": 200, "out": 10, "hash_ids": [1, 2, 3], "think_time": 7.0}]}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    (s,) = load_weka(tmp_path)
    (sub,) = s.subagents
    assert (sub.after_step, sub.offset_s, sub.waited) == (0, 1.0, True)
    assert s.steps[1].after_subagents_s == 2.0 and s.steps[1].think_s == 7.0
    assert len(sub.session.subagents) == 1 and s.all_steps() == 4
    trace["requests"][1]["requests"][0].pop("in")
    (tmp_path / "t.json").write_text(json.dumps(trace))
    with pytest.raises(ValueError, match="not a WEKA agent session trace"):
        load_weka(tmp_path)
    only_a_subagent = {"t": 1.0, "type": "subagent", "duration_ms": 1000,
                       "requests": [{"t": 0.0, "type": "n", "in": 5, "out": 1, "hash_ids": [1]}]}
    (tmp_path / "t.json").write_text(json.dumps({"id": "t", "block_size": 64, "requests": [only_a_subagent]}))
    with pytest.raises(ValueError, match="no requests of its own"):  # a replay of it would never end
        load_weka(tmp_path)


def test_a_replayed_parent_waits_for_its_subagent_and_the_session_counts_once(tmp_path):
    trace = {"id": "t", "block_size": 64, "requests": [
        {"t": 0.0, "type": "n", "in": 1000, "out": 10, "hash_ids": list(range(16)), "api_time": 1.0},
        {"t": 6.0, "type": "subagent", "duration_ms": 4000, "requests": [
            {"t": 0.0, "type": "n", "in": 500, "out": 5, "hash_ids": [90, 91]},
            {"t": 2.0, "type": "n", "in": 600, "out": 5, "hash_ids": [90, 91, 92], "think_time": 1.0}]},
        {"t": 8.0, "type": "n", "in": 1100, "out": 10, "hash_ids": list(range(18)), "think_time": 7.0}]}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    replay = agents.SessionReplay(load_weka(tmp_path), 16, seed=0)
    (first,) = replay.first(1)
    assert first.session == "t#0" and first.parent_session is None

    def complete(req, now):
        req.outcome = "completed"
        return replay.follow(req, now)

    ((delay, child),) = complete(first, 1.5)  # the parent's step ended: the subagent starts 1 s later
    assert delay == pytest.approx(1.0) and child.session == "t#0/0" and child.parent_session == "t#0"
    ((delay, child2),) = complete(child, 3.0)
    assert delay == pytest.approx(1.0)  # its own think time
    ((delay, parent2),) = complete(child2, 5.0)  # the subagent is done: the parent resumes 2 s later
    assert delay == pytest.approx(2.0) and parent2.session == "t#0" and parent2.arrival == pytest.approx(7.0)
    nxt = complete(parent2, 9.0)  # the session is done: a new one starts at once
    assert replay.done["sessions"] == 1 and replay.done["steps_of_completed"] == 4
    assert [(d, r.session) for d, r in nxt] == [(0.0, "t#1")]
    # a failed step fails its whole session, and what its subagents still had in flight is ignored
    ((_, child),) = complete(nxt[0][1], 10.0)
    child.outcome = "expired"
    assert [r.session for _, r in replay.follow(child, 11.0)] == ["t#2"]
    assert replay.done["failed_sessions"] == 1 and replay.done["steps_wasted"] == 1
    # the ablation: subagents' steps that do not name their parent
    plain = agents.SessionReplay(load_weka(tmp_path), 16, seed=0, name_parents=False)
    (first,) = plain.first(1)
    first.outcome = "completed"
    ((_, child),) = plain.follow(first, 1.5)
    assert child.session == "t#0/0" and child.parent_session is None
