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


def test_the_replay_sorts_calls_by_the_refusals_in_the_second_before_them(tmp_path):
    path = tmp_path / "calls.pickle"
    core_cost.record(str(path), "rogue-tenant", 3.0, 20.0, 1)
    result = core_cost.replay(str(path))
    for entry in core_cost.BY_QUEUE:  # every offer and tick counted once, in both breakdowns
        for key in ("by_queue", "by_refusals"):
            assert sum(c["n"] for c in result[key][entry].values()) == result["calls"][entry]["n"]
    # at three times its capacity the rogue tenant is refused many times a second: some calls
    # come after ten or more refusals in the second before them, and the first after none
    offers = result["by_refusals"]["offer"]
    assert offers["0-9"]["n"] > 0 and sum(c["n"] for b, c in offers.items() if b != "0-9") > 0
