"""A cold head at least as large as one its band already held in the same dispatch run is held
without asking the replicas (bouncer.core.fleet.placement.HeldForRoom)."""

from __future__ import annotations

from types import SimpleNamespace

from bouncer.core.fleet import placement
from bouncer.core.fleet.placement import Held, HeldForRoom
from bouncer.core.fleet.replica import Telemetry
from core_helpers import dispatched, info, make_core, tenant


def _adm(prompt: int, output: int, tpot: float | None = None):
    return SimpleNamespace(info=SimpleNamespace(prompt_tokens=prompt), expected_output=output, tpot_slo=tpot)


def test_only_a_request_no_smaller_and_no_looser_than_one_held_is_held_unasked():
    held = HeldForRoom()
    assert held.find(_adm(1000, 100)) is None
    held.add(_adm(1000, 100, tpot=0.1), Held.ROOM)
    assert held.find(_adm(1000, 100, tpot=0.1)) is Held.ROOM
    assert held.find(_adm(2000, 200, tpot=0.05)) is Held.ROOM  # larger, tighter
    assert held.find(_adm(999, 500, tpot=0.05)) is None  # a shorter prompt may fit
    assert held.find(_adm(2000, 99, tpot=0.05)) is None  # a shorter answer may fit
    assert held.find(_adm(2000, 200)) is None  # no TPOT SLO: looser than 0.1 s
    held.add(_adm(3000, 50), Held.RULE)
    assert held.find(_adm(3000, 60)) is Held.RULE


def test_a_run_asks_the_replicas_once_for_heads_of_one_size_and_still_sends_a_smaller_one(monkeypatch):
    calls = []
    room = placement.room
    monkeypatch.setattr(placement, "room", lambda *a, **k: calls.append(a[1].tenant) or room(*a, **k))
    core = make_core(replicas=1, kv_blocks=1000, tenants=[tenant("a"), tenant("b"), tenant("c")],
                     policy={"fair_hold_s": 0})
    [first] = dispatched(core.offer(info("a", prompt=100), 0.0))
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.8, running=1, waiting=0), 0.0)
    # 4,000-token prompts need 257 blocks: 0.8 + 0.26 is past the busy threshold, they wait
    assert not core.offer(info("a", prompt=4000), 0.1)
    calls.clear()
    assert not core.offer(info("c", prompt=4000), 0.2)  # its run: a's head held, c's no smaller
    assert len(calls) == 1
    [small] = dispatched(core.offer(info("b", prompt=100), 0.3))  # smaller: asked, and it fits
    assert small.tenant == "b" and first.tenant == "a"
