"""The gateway's logs: structured lines (logfmt or JSON), one access line per request, and a
rate limit so that no client can flood them.

Every record goes out as one line with `ts`, `level`, `logger` and `msg`, plus the fields its
call site passes in `extra` (`event`, `tenant`, `reason`, ...). Loggers:
- `bouncer.access`: one line per request (`event=request`), its tenant, band, outcome, layer,
  reason, status, queue wait, TTFT, duration and tokens, and an agent's step's session (and
  parent session, for a subagent's);
- `bouncer.gateway`: backends going unhealthy and back, reloads, reclaimed permits, in-flight
  drift against the engines' own counts, malformed HTTP.

The rate limit: records of one kind (logger, event, tenant, reason) beyond `burst` per second
are dropped and counted; the next one let through says how many were (`suppressed=N`). A flood
of refusals then costs a few lines a second, not one per refusal, while every completed request
keeps its line.
"""

from __future__ import annotations

import logging
import re
import sys
import time

import orjson

# attributes every LogRecord has; anything else on a record came from `extra`
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
RATE_BURST = 20  # records of one kind let through per second


_NEEDS_QUOTES = re.compile(r'[ "=\\\x00-\x1f\x7f]')
# a value's control characters written as escapes: a client's text (a session id, a model name)
# cannot start a forged line or hide part of one (`\r` rewinds a terminal's line)
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_second: list = [None, ""]  # the last whole second formatted, and its text: every access line asks


def _timestamp(created: float) -> str:
    """UTC, to the millisecond, as `2026-12-03T06:31:02.123Z`. The date and time of a second are
    formatted once: one access line per request made this a visible part of a request's cost."""
    whole = int(created)
    if _second[0] != whole:
        _second[0], _second[1] = whole, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
    return f"{_second[1]}.{int((created - whole) * 1000):03d}Z"


def _fields(record: logging.LogRecord) -> dict:
    out = {"ts": _timestamp(record.created), "level": record.levelname.lower(), "logger": record.name,
           "msg": record.getMessage()}
    for key, value in record.__dict__.items():
        if value is not None and key not in _STANDARD:
            out[key] = value
    if record.exc_info and record.levelno >= logging.ERROR:
        out["exc"] = logging.Formatter().formatException(record.exc_info)
    return out


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return orjson.dumps(_fields(record), default=str).decode()


def _logfmt_value(value) -> str:
    kind = type(value)
    if kind is int:
        return str(value)
    if kind is float:
        return f"{value:.6g}"
    text = value if kind is str else str(value)
    if text and _NEEDS_QUOTES.search(text) is None:
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    escaped = _CONTROL.sub(lambda m: _ESCAPES.get(m.group(), f"\\x{ord(m.group()):02x}"), escaped)
    return '"' + escaped + '"'


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join([f"{k}={_logfmt_value(v)}" for k, v in _fields(record).items()])


class RateLimit(logging.Filter):
    """At most `burst` records per second of each kind; completed requests' access lines pass."""

    def __init__(self, burst: int = RATE_BURST, clock=time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.clock = clock
        self._windows: dict[tuple, list] = {}  # kind -> [window start, let through, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "outcome", None) == "completed":
            return True
        let = self.let_through((record.name, getattr(record, "event", record.msg), getattr(record, "tenant", None),
                                getattr(record, "reason", None)))
        if let:  # a count of lines dropped before it
            record.suppressed = let
        return let is not None

    def let_through(self, kind: tuple) -> int | None:
        """None: drop this line; else how many of its kind were dropped since the last one let
        through (0: none)."""
        now = self.clock()
        w = self._windows.get(kind)
        if w is None or now - w[0] >= 1.0:
            suppressed = w[2] if w is not None else 0
            if len(self._windows) > 10_000:  # kinds include tenant names: bound them
                self._windows.clear()
            self._windows[kind] = [now, 1, 0]
            return suppressed
        if w[1] < self.burst:
            w[1] += 1
            return 0
        w[2] += 1
        return None


_access = logging.getLogger("bouncer.access")
_bouncer = logging.getLogger("bouncer")
_direct: tuple[logging.StreamHandler, RateLimit, bool] | None = None  # what `configure` installed


def access(fields: dict) -> None:
    """One request's access line: `bouncer.access`, event=request, then `fields`.

    Where `configure` installed Bouncer's own handler (the gateway as `bouncer serve` runs it),
    the line is formatted and written here, the same text through the same rate limit: through
    `logging` (a LogRecord, the caller's frame looked up, filters) it cost a running gateway about
    45 us of CPU, a sixth of a short request's. Anywhere else (tests' and library users'
    handlers) it goes through `logging` like any record."""
    direct = _direct
    if direct is None or _bouncer.handlers != [direct[0]] or not _access.isEnabledFor(logging.INFO):
        _access.info("request", extra={"event": "request", **fields})
        return
    handler, limit, as_json = direct
    suppressed = 0
    if fields.get("outcome") != "completed":
        let = limit.let_through(("bouncer.access", "request", fields.get("tenant"), fields.get("reason")))
        if let is None:
            return
        suppressed = let
    out = {"ts": _timestamp(time.time()), "level": "info", "logger": "bouncer.access", "msg": "request",
           "event": "request"}
    for key, value in fields.items():
        if value is not None:
            out[key] = value
    if suppressed:
        out["suppressed"] = suppressed
    line = orjson.dumps(out, default=str).decode() if as_json else \
        " ".join([f"{k}={_logfmt_value(v)}" for k, v in out.items()])
    handler.acquire()
    try:
        handler.stream.write(line + "\n")
        handler.stream.flush()
    except Exception:
        handler.handleError(logging.makeLogRecord({"msg": line}))
    finally:
        handler.release()


def configure(level: str = "info", fmt: str = "logfmt", stream=None) -> logging.Handler:
    """Send Bouncer's and aiohttp's logs to `stream` (stderr) as `fmt` lines at `level`."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter() if fmt == "logfmt"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    limit = RateLimit()
    handler.addFilter(limit)
    global _direct
    _direct = (handler, limit, fmt == "json") if fmt in ("json", "logfmt") else None
    # no line shows a record's process or thread: not looking them up saves part of every line's cost
    logging.logProcesses = logging.logThreads = logging.logMultiprocessing = False
    for name in ("bouncer", "aiohttp"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    # aiohttp logs every malformed request with a traceback; ours (connections.py) are one line
    logging.getLogger("aiohttp.server").setLevel(logging.CRITICAL)
    logging.getLogger("aiohttp.access").setLevel(logging.CRITICAL)
    return handler
