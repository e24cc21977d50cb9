"""Polling the outside signals of `pressure:` and telling the core what they read.

One task per signal reads its source every `poll_s` and reports the value with the time it is
from: a file's value is as old as the file; an HTTP answer is from the poll, or from its
`timestamp_field` (epoch seconds); a schedule's value is always current. A read that fails
(missing file, an error status, a body that holds no number) reports nothing, so the value ages
and, once stale, the signal's `on_stale` decides; failures are logged, the first one and then
every tenth.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import pathlib
import time
from collections.abc import Callable

import aiohttp

from bouncer.config import Pressure, PressureSource

log = logging.getLogger("bouncer.gateway")

HTTP_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 64 * 1024


class UnreadableSignal(Exception):
    pass


def parse_value(text: str, source: PressureSource, wall_now: float) -> tuple[float, float]:
    """(value, its age in seconds) from a source's answer: a bare number, or JSON with `field`."""
    text = text.strip()
    if source.field is None:
        try:
            return float(text), 0.0
        except ValueError:
            raise UnreadableSignal(f"not a number: {text[:80]!r}") from None
    try:
        doc = json.loads(text)
    except ValueError:
        raise UnreadableSignal("not JSON (the source names a field)") from None
    value = _field(doc, source.field)
    age = 0.0
    if source.timestamp_field is not None:
        age = max(0.0, wall_now - _field(doc, source.timestamp_field))
    return value, age


def _field(doc: object, path: str) -> float:
    for part in path.split("."):
        if not isinstance(doc, dict) or part not in doc:
            raise UnreadableSignal(f"no field {path!r} in the answer")
        doc = doc[part]
    if isinstance(doc, bool) or not isinstance(doc, (int, float, str)):
        raise UnreadableSignal(f"{path!r} is not a number")
    try:
        return float(doc)
    except ValueError:
        raise UnreadableSignal(f"{path!r} is not a number") from None


def scheduled_value(source: PressureSource, wall_now: float) -> float:
    """The value of the last point at or before the UTC time of day (the day's last point
    before the first one)."""
    t = datetime.datetime.fromtimestamp(wall_now, datetime.UTC)
    minute = t.hour * 60 + t.minute
    points = sorted(source.schedule, key=lambda p: p.at)
    current = points[-1].value
    for p in points:
        h, m = p.at.split(":")
        if int(h) * 60 + int(m) <= minute:
            current = p.value
    return current


async def read(source: PressureSource, session: aiohttp.ClientSession) -> tuple[float, float]:
    wall_now = time.time()
    if source.kind == "schedule":
        return scheduled_value(source, wall_now), 0.0
    if source.kind == "file":
        path = pathlib.Path(source.path)  # type: ignore[arg-type]
        try:
            text, mtime = await asyncio.to_thread(lambda: (path.read_text(errors="replace"), path.stat().st_mtime))
        except OSError as exc:
            raise UnreadableSignal(f"{path}: {exc.strerror or exc}") from None
        value, age = parse_value(text, source, wall_now)
        return value, max(age, wall_now - mtime, 0.0)
    try:
        async with session.get(source.url, timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)) as resp:
            if resp.status != 200:
                raise UnreadableSignal(f"{source.url} answered {resp.status}")
            body = await resp.content.read(MAX_BODY_BYTES)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise UnreadableSignal(f"{source.url}: {exc or type(exc).__name__}") from None
    return parse_value(body.decode(errors="replace"), source, wall_now)


async def poll(cfg: Pressure, session: aiohttp.ClientSession, report: Callable[[str, float, float], None],
               clock: Callable[[], float]) -> None:
    """Until cancelled: read the source, report (name, value, when it is from), sleep poll_s."""
    failures = 0
    while True:
        try:
            value, age = await read(cfg.source, session)
            report(cfg.name, value, clock() - age)
            failures = 0
        except UnreadableSignal as exc:
            failures += 1
            if failures % 10 == 1:
                log.warning("pressure signal %s unreadable: %s", cfg.name, exc,
                            extra={"event": "pressure_unreadable", "signal": cfg.name, "error": str(exc),
                                   "failures": failures})
        await asyncio.sleep(cfg.poll_s)
