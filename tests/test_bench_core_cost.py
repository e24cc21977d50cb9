"""`bouncer bench core`'s record and replay: the replay decides what the run decided, and its
digest of those decisions tells an exact change (same events on every call) from one that is not."""

from __future__ import annotations

import pickle

import pytest

from bouncer.bench import core_cost, goodput


@pytest.fixture(autouse=True)
def capacity_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(goodput, "CACHE_DIR", tmp_path / "capacity")


def test_replays_of_one_recording_decide_alike_and_a_changed_core_does_not(tmp_path):
    path = tmp_path / "calls.pickle"
    n = core_cost.record(str(path), "rogue-tenant", 2.0, 20.0, 1)
    assert n > 100
    first, second = core_cost.replay(str(path)), core_cost.replay(str(path))
    assert first["calls"]["offer"]["n"] > 0 and first["total_seconds"] > 0
    assert first["decisions_sha256"] == second["decisions_sha256"]
    # the same calls on a core that decides otherwise (no refusal of late requests) digest otherwise
    recorded = pickle.loads(path.read_bytes())
    recorded["config"].setdefault("policy", {})["refuse_infeasible"] = False
    changed = tmp_path / "changed.pickle"
    changed.write_bytes(pickle.dumps(recorded))
    assert core_cost.replay(str(changed))["decisions_sha256"] != first["decisions_sha256"]
