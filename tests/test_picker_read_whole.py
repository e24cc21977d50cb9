"""Which answers the endpoint picker reads to their end (the buffered setup's sample): at most
`picker.answers_read_whole` at once, begun at least `READ_WHOLE_EVERY_S` apart, so that unloaded
not every answer pays the round trip on each of its chunks."""

from __future__ import annotations

from types import SimpleNamespace

from bouncer.gateway.fronts.picker_ledger import READ_WHOLE_EVERY_S, Ledger


def _picker(at_once: int) -> Ledger:
    picker_cfg = SimpleNamespace(answers_read_whole=at_once)
    return Ledger(SimpleNamespace(clock=lambda: 0.0, config=SimpleNamespace(picker=picker_cfg)))


def test_one_at_a_time_and_no_sooner_than_the_interval():
    p = _picker(1)
    assert p._reads_whole(1.0)
    assert not p._reads_whole(1.0 + 2 * READ_WHOLE_EVERY_S)  # the first is still being read
    p._reading_whole -= 1  # it ended (`Ledger.end`)
    assert not p._reads_whole(1.0 + READ_WHOLE_EVERY_S / 2)  # room, but too soon after it began
    assert p._reads_whole(1.0 + READ_WHOLE_EVERY_S)


def test_room_for_several_still_spaces_them():
    p = _picker(4)
    assert p._reads_whole(0.0)
    assert not p._reads_whole(READ_WHOLE_EVERY_S / 10)  # unloaded traffic: most answers go unread
    assert p._reads_whole(READ_WHOLE_EVERY_S)
    assert p._reading_whole == 2


def test_none_read_whole_when_the_config_says_none():
    assert not _picker(0)._reads_whole(0.0)
