"""The endpoint picker's ledger: the requests Envoy is serving, and how each one ends.

A request routed by the picker (`bouncer.gateway.fronts.picker`) is opened here and ended here,
once, whichever word of its end comes first: its ext_proc stream's end (full duplex), its answer
read to its end with its usage, Envoy's access log (the buffered setup), its Envoy gone, or the
sweep that gives up on ends that never came. Ending it returns its permit through the control
plane and writes its access line. Which answers are read to their end (the buffered setup's
sample) is decided here too, since an answer read whole counts until its end.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field

from bouncer.core.journey import Outcome
from bouncer.core.outcomes import Dispatch, Reason, Terminal
from bouncer.gateway.control_plane import ControlPlane
from bouncer.gateway.fronts.access_log_wire import Ended
from bouncer.gateway.fronts.ext_proc_wire import read_usage_of
from bouncer.gateway.parsed_request import Exchange

log = logging.getLogger("bouncer.gateway")

USAGE_TAIL_BYTES = 8192  # of a stream read whole, kept for its usage event
ENVOY_GONE_AFTER_S = 1.0  # an Envoy whose access log closed and did not reopen within this is gone
# An answer read to its end: Envoy logs its request within its flush interval (20 ms in
# `bouncer envoy-config`'s bootstrap), opening its access log stream if none is open. One whose
# log has not opened this long after has none (`Ledger.envoys_without_log`).
ACCESS_LOG_DUE_S = 5.0
# An answer read whole holds its every chunk (its end included) until the picker answers it: a
# round trip in its client's way (0.3 ms of the median unloaded, `scripts/ext_proc_floor.py`).
# Unloaded, one at a time would be every answer; a new one begins at most this often, which
# leaves up to ten a second for what they teach (output lengths, TPOT) and most answers unheld.
READ_WHOLE_EVERY_S = 0.1


@dataclass(slots=True)
class Served:
    """A dispatched request Envoy is serving: what the picker knows of it until its end."""

    dispatch: Dispatch
    streaming: bool
    duplex: bool  # every chunk passes through the picker, and the stream's end is the request's
    read_whole: bool  # its answer is read to its end (for its usage)
    envoy: str  # the host of the Envoy that asked (`peer_host`): its access log says when the request ends
    envoy_id: str | None  # Envoy's `x-request-id` for it: its end where the picker's own header never reached it
    ex: Exchange  # its exchange: its access line, closed at its end
    out: Outcome = field(default_factory=lambda: Outcome(Terminal.COMPLETED, None, None))
    tail: bytearray = field(default_factory=bytearray)  # the answer's last bytes (a whole one's, not streamed)
    read_to_end: bool = False  # the answer was read to its end
    done: bool = False  # its permit went back


class Ledger:
    """The requests Envoy is serving for this picker, each until its end."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.clock = plane.clock
        self._served: dict[str, Served] = {}
        # Envoy's `x-request-id` -> the picker's ids served under it, for the buffered setup's
        # ends; one a client sent itself may be shared, and then none is found by it
        self._by_envoy_id: dict[str, set[str]] = {}
        self._reading_whole = 0  # answers being read to their end now (the buffered setup's sample)
        self._read_whole_at = float("-inf")  # when the last of them began
        self._logs_open: Counter[str] = Counter()  # Envoy host -> its access log streams open now
        self._logs_seen: set[str] = set()  # Envoy hosts whose access log ever opened
        self._read_to_end_at: dict[str, float] = {}  # Envoy host -> when an answer it carried was first read to its end
        self._warned: set[str] = set()  # hosts warned of as having no access log

    def open(self, d: Dispatch, streaming: bool, duplex: bool, envoy: str, envoy_id: str | None,
             ex: Exchange) -> Served:
        """A dispatched request Envoy now serves; in full duplex every answer is read whole."""
        read_whole = duplex or self._reads_whole(self.clock())
        served = self._served[d.request_id] = Served(d, streaming, duplex, read_whole, envoy,
                                                     None if duplex else envoy_id, ex)
        if served.envoy_id is not None:
            self._by_envoy_id.setdefault(served.envoy_id, set()).add(d.request_id)
        return served

    def _reads_whole(self, now: float) -> bool:
        """Whether an answer dispatched `now` is read to its end (the buffered setup's sample): at
        most `picker.answers_read_whole` at once, begun at least `READ_WHOLE_EVERY_S` apart. One
        that is counts until its `end`."""
        if (self._reading_whole >= self.plane.config.picker.answers_read_whole
                or now - self._read_whole_at < READ_WHOLE_EVERY_S):
            return False
        self._reading_whole += 1
        self._read_whole_at = now
        return True

    def chunk(self, served: Served, body: bytes, end: bool, at: float) -> None:
        """A chunk of the answer, come `at`: the first is its first token (a stream's) or says its
        prefill is over (a whole answer's); an answer read whole ends at its usage."""
        if body and served.out.first_token_at is None:
            # an error instead of a stream (a replica's JSON refusal) is no token
            token = body.startswith(b"data:") if served.streaming else True
            if token:
                served.out.first_token_at = at
                self.plane.started(served.dispatch.request_id, at, measured=served.streaming)
        if not served.read_whole:
            return
        served.tail += body
        if served.streaming and len(served.tail) > USAGE_TAIL_BYTES:  # the usage is in the last event
            del served.tail[:-USAGE_TAIL_BYTES]
        # a stream is over at its [DONE] event: its client may hang up before the body's end reaches here
        if not served.read_to_end and (end or (served.streaming and b"data: [DONE]" in served.tail)):
            served.read_to_end = True
            served.out.completion_tokens = None
            if read_usage_of(served.tail, served.streaming, served.out) and not served.duplex:
                # a usage is a completed answer's: no need to wait for the access log
                served.ex.line["status"] = 200
                self._read_to_end_at.setdefault(served.envoy, self.clock())
                self.end(served)

    def ended(self, e: Ended, envoy: str) -> None:
        """The access log's word on how a request ended (the buffered setup), from the Envoy host
        `envoy`: only the Envoy that carried a request can end it. One whose client left before
        Envoy took the picker's answer carries no id of the picker's: it is found by Envoy's. A
        whole answer not read whole was not seen at all: `answered_after_s`, Envoy's time from
        sending the request to the replica to its answer's first byte, dates that answer on the
        picker's clock."""
        rid = e.request_id
        if rid is None and len(ids := self._by_envoy_id.get(e.envoy_request_id, ())) == 1:
            (rid,) = ids
        served = self._served.get(rid) if rid is not None else None
        if served is None or served.done or served.envoy != envoy:
            return  # ended already (read whole), not this picker's, or not that Envoy's to end
        served.ex.line["status"] = e.status
        out = served.out
        out.terminal, out.reason = e.terminal, e.reason
        if e.terminal is not Terminal.COMPLETED or not served.read_to_end:
            out.completion_tokens = None  # its length is known only where it was read to its end
        answered_after = None if served.streaming else e.answered_after_s
        self.end(served, None if answered_after is None else served.dispatch.dispatched_at + answered_after)

    def log_opened(self, envoy: str) -> None:
        self._logs_open[envoy] += 1
        self._logs_seen.add(envoy)

    def envoys_without_log(self) -> list[str]:
        """The Envoy hosts that carried an answer the picker read to its end `ACCESS_LOG_DUE_S`
        ago or more, and never opened the access log that would have logged it: a bootstrap
        without Bouncer's access log (an older `bouncer envoy-config`'s, or one written by
        hand). Their requests' ends never come; each new one is warned of once."""
        now = self.clock()
        missing = [e for e, at in self._read_to_end_at.items()
                   if now - at >= ACCESS_LOG_DUE_S and e not in self._logs_seen]
        for envoy in missing:
            if envoy not in self._warned:
                self._warned.add(envoy)
                log.warning("an Envoy routes requests through this picker but never opened its access log: "
                            "their ends are not seen, and their permits go back only after "
                            "picker.end_unseen_after_s; give it the access log `bouncer envoy-config` writes",
                            extra={"event": "picker_no_access_log", "envoy": envoy})
        return missing

    def log_closed(self, envoy: str) -> None:
        """An Envoy's access log stream closed: where none of its streams comes back within
        `ENVOY_GONE_AFTER_S`, that Envoy is gone, and so are the requests it was serving."""
        self._logs_open[envoy] -= 1
        if self._logs_open[envoy] <= 0:
            del self._logs_open[envoy]
            asyncio.get_running_loop().call_later(ENVOY_GONE_AFTER_S, self._envoy_gone, envoy)

    def _envoy_gone(self, envoy: str) -> None:
        if envoy in self._logs_open:
            return  # it (or another Envoy on that host) is back: its log will tell
        gone = [s for s in self._served.values() if s.envoy == envoy and not s.duplex]
        for served in gone:
            served.out.terminal, served.out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
            self._unseen(served)
        if gone:
            self.plane.metrics.picker_ends_unseen.inc(len(gone))
            log.warning("the Envoy serving these requests went away; their permits go back",
                        extra={"event": "picker_envoy_gone", "envoy": envoy, "requests": len(gone)})

    def _unseen(self, served: Served) -> None:
        served.ex.line["end_unseen"] = True
        served.out.completion_tokens = None
        self.end(served)

    def give_up(self, older_than_s: float) -> int:
        """End the requests whose end should have come long ago (an Envoy that died with them in
        flight): completed, length unknown. Returns how many."""
        now = self.clock()
        stale = [s for s in self._served.values() if now - s.dispatch.dispatched_at > older_than_s]
        for served in stale:
            log.warning("no end came for a request the picker routed; its permit goes back",
                        extra={"event": "picker_end_unseen", "rid": served.dispatch.request_id})
            self._unseen(served)
        return len(stale)

    def end(self, served: Served, answered_at: float | None = None) -> None:
        """The permit goes back, once. `answered_at`: when a whole answer the picker did not see
        came, as Envoy's log dates it."""
        if served.done:
            return
        served.done = True
        d = served.dispatch
        rid = d.request_id
        self._served.pop(rid, None)
        if served.envoy_id is not None:
            ids = self._by_envoy_id[served.envoy_id]
            ids.discard(rid)
            if not ids:
                del self._by_envoy_id[served.envoy_id]
        if served.read_whole and not served.duplex:
            self._reading_whole -= 1
        out = served.out
        if served.duplex and not served.read_to_end and out.terminal is Terminal.COMPLETED:
            # its stream ended before its answer did: its client left (or its replica cut it)
            out.terminal, out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
        if out.first_token_at is None and out.terminal is Terminal.COMPLETED:
            # an answer that came whole (or whose first chunk was missed): its prefill is over
            now = self.clock()
            self.plane.started(rid, now, measured=False)  # (the core's clock only goes forward)
            if answered_at is not None:  # for the TTFT metric and the access line
                out.first_token_at = min(now, answered_at)
        self.plane.finish(served.ex, d, out, served.streaming)
        self.plane.close_exchange(served.ex, served.ex.line.get("status"))
