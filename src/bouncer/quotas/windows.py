"""Calendar windows: which window an instant falls in, and when it resets. Explicit time in
(seconds since the epoch), no clock read.

Windows are the local calendar's, in an IANA time zone: an hour from :00, a day from 00:00, a
week from Monday 00:00, a month from the 1st at 00:00. A day across a daylight-saving change is
23 or 25 hours long, as its clock says; an hour is always 3,600 s.
"""

from __future__ import annotations

import datetime as dt
import zoneinfo
from functools import lru_cache
from typing import NamedTuple

from bouncer.quotas.settings import WindowKind


class Window(NamedTuple):
    start: float  # seconds since the epoch
    end: float  # the reset: the next window's start
    label: str  # names it in keys and metrics: 2026-12, 2026-W49, 2026-12-05, 2026-12-05T10+0100


@lru_cache(maxsize=64)
def zone(name: str) -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(name)


def _midnight(day: dt.date, tz: zoneinfo.ZoneInfo) -> float:
    return dt.datetime(day.year, day.month, day.day, tzinfo=tz).timestamp()


def window_at(kind: WindowKind, time_zone: str, at: float) -> Window:
    """The `kind` window of `time_zone` that `at` falls in."""
    tz = zone(time_zone)
    local = dt.datetime.fromtimestamp(at, tz)
    if kind == "hour":
        start = local.replace(minute=0, second=0, microsecond=0).timestamp()
        # labelled with its offset: the hour an autumn clock repeats is another window
        return Window(start, start + 3600.0, local.strftime("%Y-%m-%dT%H%z"))
    day = local.date()
    if kind == "day":
        return Window(_midnight(day, tz), _midnight(day + dt.timedelta(days=1), tz), day.isoformat())
    if kind == "week":
        monday = day - dt.timedelta(days=day.weekday())
        year, week, _ = monday.isocalendar()
        return Window(_midnight(monday, tz), _midnight(monday + dt.timedelta(days=7), tz), f"{year}-W{week:02d}")
    if kind == "month":
        first = day.replace(day=1)
        following = (first + dt.timedelta(days=32)).replace(day=1)
        return Window(_midnight(first, tz), _midnight(following, tz), first.strftime("%Y-%m"))
    raise ValueError(f"unknown window {kind!r}")
