"""Relaying an admitted request's answer from its backend to the client.

Whatever the backend does, the client gets an OpenAI-shaped answer with a documented status:
- 200 with a JSON object (non-streaming) or an event stream whose first event is a chunk: relayed
  as it came. Usage is read on the way (robustly: a malformed `usage` is ignored, and the
  completion is then counted from the chunks);
- 429 / 503 / 529, or a stream whose first event is a 429 or 503 error (vLLM refuses some streams
  that way): `Requeue`, raised before anything reached the client, so the core holds the request
  again (with the backend's Retry-After, if it gave one);
- any other 4xx: 400 `upstream_rejected`, with the backend's own message where it sent one;
- anything else (5xx, 1xx, 3xx, a status no server should send, a body that is not what it
  claims): 502 `upstream_error`.
Once the response to the client has started, a failure ends the stream with an SSE error event
(`data: {"error": ...}`, which the OpenAI SDKs raise as an APIError), never a cut chunked body.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NamedTuple

import orjson
from aiohttp import web

from bouncer.core.journey import Outcome
from bouncer.core.outcomes import Reason, Terminal
from bouncer.gateway.upstream import UpstreamError, UpstreamResponse, UpstreamTimeout
from bouncer.openai_wire import ApiError, dumps

REFUSAL_STATUSES = (429, 503, 529)  # the backend is full for now: hold the request and send it again
MAX_ERROR_MESSAGE = 500  # characters of a backend's own error message passed on


class Requeue(Exception):
    """The backend refused the request for load before anything reached the client."""

    def __init__(self, retry_after: float | None) -> None:
        super().__init__("refused by the backend")
        self.retry_after = retry_after


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


class UpstreamFailure(Exception):
    """The backend failed before the response to the client started: answer with this error."""

    def __init__(self, status: int, reason: Reason, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.retry_after = retry_after


def retry_after_header(headers: dict[str, str]) -> float | None:
    """A backend's Retry-After in seconds (delta-seconds form only; dates are ignored)."""
    raw = headers.get("retry-after-ms")
    try:
        if raw is not None:
            return max(0.0, float(raw) / 1000)
        raw = headers.get("retry-after")
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:
        return None


def _backend_message(raw: bytes) -> str | None:
    """The message of an OpenAI-style (or vLLM / FastAPI-style) error body, if it is one."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    for candidate in (err.get("message") if isinstance(err, dict) else err, obj.get("message"), obj.get("detail")):
        if isinstance(candidate, str) and candidate:
            return candidate[:MAX_ERROR_MESSAGE]
    return None


def failure_reason(status: int | None) -> Reason:
    """What an answer other than 200 says of its replica, by its status alone (both fronts' rule):
    full for now, the request found invalid, or failed."""
    if status in REFUSAL_STATUSES:
        return Reason.UPSTREAM_REFUSED
    if status is not None and 400 <= status < 500:
        return Reason.UPSTREAM_REJECTED
    return Reason.UPSTREAM_ERROR


def failure_for_status(status: int, headers: dict[str, str], raw: bytes) -> UpstreamFailure | Requeue:
    reason = failure_reason(status)
    if reason is Reason.UPSTREAM_REFUSED:  # before anything reached the client: held again
        return Requeue(retry_after_header(headers))
    if reason is Reason.UPSTREAM_REJECTED:
        message = _backend_message(raw) or f"the backend rejected the request ({status})"
        return UpstreamFailure(400, reason, message)
    return UpstreamFailure(502, reason, f"the backend answered {status}")


def _count(usage: Any, field: str) -> int | None:
    n = usage.get(field) if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def completion_tokens(obj: dict[str, Any]) -> int | None:
    """`usage.completion_tokens`, where the backend sent a sensible one."""
    return _count(obj.get("usage"), "completion_tokens")


def read_usage(obj: Any, out: Outcome) -> bool:
    """The backend's own usage (prompt and completion tokens) into `out`, where it sent a
    sensible one; whether it did."""
    usage = obj.get("usage") if isinstance(obj, dict) else None
    completion = _count(usage, "completion_tokens")
    if completion is None:
        return False
    out.completion_tokens = completion
    prompt = _count(usage, "prompt_tokens")
    if prompt is not None:
        out.prompt_tokens = prompt
    return True


def has_content(obj: dict[str, Any]) -> bool:
    """A chunk that carries generated tokens (its first token, for TTFT): text, a tool call, or
    reasoning."""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and (
                delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")
                or delta.get("reasoning"))):
            return True
    return False


def event_json(event: bytes) -> Any:
    """The JSON of an SSE event's `data:` line (None for `[DONE]`, no data, or not JSON)."""
    for line in event.splitlines():
        if line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                return None
            try:
                return orjson.loads(data)
            except orjson.JSONDecodeError:
                return None
    return None


class EventSplitter:
    """Whole server-sent events (their bytes, blank line included) from an upstream body's chunks;
    `rest` is what came of an event not yet whole."""

    __slots__ = ("rest",)

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self.rest + chunk if self.rest else chunk
        events = []
        while True:
            lf = buf.find(b"\n\n")
            crlf = buf.find(b"\r\n\r\n")
            if lf < 0 and crlf < 0:
                break
            end = lf + 2 if crlf < 0 or 0 <= lf < crlf else crlf + 4
            events.append(buf[:end])
            buf = buf[end:]
        self.rest = buf
        return events


async def sse_batches(chunks: AsyncIterator[bytes], splitter: EventSplitter) -> AsyncIterator[list[bytes]]:
    """The events completed by each chunk received, in batches, so they can be relayed in one
    write; a last event left without its blank line is closed."""
    async for chunk in chunks:
        batch = splitter.feed(chunk)
        if batch:
            yield batch
    if splitter.rest.strip():
        last, splitter.rest = splitter.rest + b"\n\n", b""
        yield [last]


# a chunk's `"usage": {...}` member (one level of nesting: `prompt_tokens_details`), or a null one
_USAGE_MEMBER = re.compile(rb',\s*"usage"\s*:\s*(?:null|\{(?:[^{}]|\{[^{}]*\})*\})')


def without_usage(event: bytes) -> bytes:
    """A chunk with its `usage` taken out: the usage the gateway asked for in every chunk, which
    a client that did not ask for it should not see (clients that add up chunks' usage would
    count it once a chunk)."""
    cut, n = _USAGE_MEMBER.subn(b"", event, count=1)
    if n:
        return cut
    obj = event_json(event)  # another layout (usage first): the slow way
    if not isinstance(obj, dict) or "usage" not in obj:
        return event
    del obj["usage"]
    return b"data: " + dumps(obj) + b"\n\n"


def _is_usage_only(event: bytes) -> bool:
    """The stream's last chunk, its usage and no choices."""
    return b'"choices":[]' in event or b'"choices": []' in event


def error_event(status: int, reason: Reason, message: str) -> bytes:
    err = ApiError(status, message, "api_error", code=reason, layer="upstream", reason=reason)
    return b"data: " + dumps(err.body()) + b"\n\n"


class Timeouts(NamedTuple):
    read: float  # silence on the backend's side this long is its failure
    send: float  # a client that takes nothing of its answer this long (listen.send_timeout_s) is cut off


async def relay_json(up: UpstreamResponse, request: web.Request, timeouts: Timeouts, clock: Callable[[], float],
                     on_first_token: Callable[[float], None], out: Outcome,
                     headers: dict[str, str] | None = None) -> web.Response:
    """A non-streaming answer: the whole body, relayed if it is a JSON object. It is written
    here, not by aiohttp once the handler returns, so that the client has it before the
    gateway's bookkeeping (the core told, metrics, the access line) runs: that work is off the
    answer's latency. A client that leaves before it came saw nothing of it, and neither did
    the gateway: its usage is not known (`out.completion_tokens` None)."""
    try:
        raw = await up.read(timeouts.read)
    except asyncio.CancelledError:
        out.completion_tokens = None
        raise
    return await answer_json(raw, request, timeouts.send, clock, on_first_token, out, headers)


async def answer_json(raw: bytes, request: web.Request, send_timeout: float, clock: Callable[[], float],
                      on_first_token: Callable[[float], None], out: Outcome,
                      headers: dict[str, str] | None = None) -> web.Response:
    """`relay_json` once the whole answer is in; `headers`: the gateway's own to add."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise UpstreamFailure(502, Reason.UPSTREAM_ERROR, "the backend's answer is not a JSON object")
    out.first_token_at = clock()
    on_first_token(out.first_token_at)
    if not read_usage(obj, out):
        out.completion_tokens = 0
    out.terminal, out.reason = Terminal.COMPLETED, None  # served, whether or not the client is still there
    resp = web.Response(body=raw, content_type="application/json", headers=headers)
    with contextlib.suppress(ClientGone):  # served: a client that left or took nothing of it changes nothing
        sink = ClientSink(resp, request, send_timeout)
        await sink.prepare()
        await sink.write_eof(len(raw))
    return resp


class ClientUsage(NamedTuple):
    """What a streaming client asked for of the usage: none, the last chunk's
    (`include_usage`), or every chunk's too (`continuous_usage_stats`)."""

    last: bool
    every_chunk: bool

    @staticmethod
    def of(body: dict[str, Any]) -> ClientUsage:
        options = body.get("stream_options") or {}  # checked: an object
        last = bool(options.get("include_usage"))
        return ClientUsage(last, last and bool(options.get("continuous_usage_stats")))


class _StreamTally:
    """What a relayed stream has shown of the engine's work: content chunks, and the last chunk
    that carried a usage (parsed once, at the end: with usage in every chunk, parsing each would
    cost a JSON parse a token)."""

    __slots__ = ("content", "usage_event")

    def __init__(self) -> None:
        self.content = 0
        self.usage_event: bytes | None = None

    def see(self, events: list[bytes]) -> None:
        """Events the engine sent that were not relayed (its stream cut short)."""
        for event in events:
            if b'"usage"' in event:
                self.usage_event = event
            if _CHOICE in event or _CHOICE_SPACED in event:
                self.content += 1

    def settle(self, out: Outcome) -> None:
        """The engine's last usage where it sent one (all of it at a stream's end; what it had
        generated by its last chunk, where it sends usage in every chunk), else the content
        chunks counted: each carries at least one token, but for an engine's opening chunk
        (vLLM's names the role and no token)."""
        if self.usage_event is None or not read_usage(event_json(self.usage_event), out):
            out.completion_tokens = self.content


_CHOICE, _CHOICE_SPACED = b'"choices":[{', b'"choices": [{'


async def relay_stream(up: UpstreamResponse, request: web.Request, timeouts: Timeouts, client: ClientUsage,
                       every_chunk_asked: bool, clock: Callable[[], float], on_first_token: Callable[[float], None],
                       out: Outcome, headers: dict[str, str] | None = None) -> web.StreamResponse:
    """An event stream: its first event is read before the response starts, so a refusal or an
    error there is still a clean HTTP error; then events are relayed as they come.
    `every_chunk_asked`: the gateway asked the engine for usage in every chunk
    (`upstream_body`); the client sees it only where it asked for it too. However the stream
    ends (the client leaving, the backend failing), `out` gets what the engine had used by then:
    its last usage, or what it had sent, counting what came and was not relayed."""
    splitter = EventSplitter()
    batches = sse_batches(up.chunks(timeouts.read), splitter)
    batch = await anext(batches, None)
    if not batch:
        raise UpstreamFailure(502, Reason.UPSTREAM_ERROR, "the backend closed the stream without an event")
    first = event_json(batch[0])
    if not isinstance(first, dict):
        raise UpstreamFailure(502, Reason.UPSTREAM_ERROR, "the backend's stream does not start with a JSON event")
    if "error" in first:
        err = first["error"]
        code = err.get("code") if isinstance(err, dict) else None
        if code in (429, 503, "429", "503"):
            raise Requeue(None)
        message = err.get("message") if isinstance(err, dict) else err
        message = message[:MAX_ERROR_MESSAGE] if isinstance(message, str) and message else "an error event"
        raise UpstreamFailure(502, Reason.UPSTREAM_ERROR, f"the backend sent {message}")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       **(headers or {})})
    sink = ClientSink(resp, request, timeouts.send)
    tally = _StreamTally()
    strip = every_chunk_asked and not client.every_chunk
    try:
        await sink.prepare()
        try:
            while batch is not None:
                await _relay_batch(batch, sink, client, strip, clock, on_first_token, out, tally)
                batch = await anext(batches, None)
        except (UpstreamError, TimeoutError) as exc:
            timeout = isinstance(exc, UpstreamTimeout | TimeoutError)
            out.reason = Reason.UPSTREAM_TIMEOUT if timeout else Reason.UPSTREAM_ERROR
            tally.settle(out)
            await sink.write(error_event(504 if timeout else 502, out.reason, "the backend failed mid-stream"))
            await sink.write_eof()
            return resp
        tally.settle(out)
        await sink.write_eof()
        out.terminal, out.reason = Terminal.COMPLETED, None
    except (ClientGone, asyncio.CancelledError) as exc:
        # the client left: what the engine sent meanwhile, read and not yet relayed, was used
        # too; closing the unfinished upstream response (the caller does) makes the engine abort
        tally.see(splitter.feed(up.drain()))
        tally.settle(out)
        out.terminal, out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
        if isinstance(exc, asyncio.CancelledError):
            raise
    return resp


async def _relay_batch(batch: list[bytes], sink: ClientSink, client: ClientUsage, strip: bool,
                       clock: Callable[[], float], on_first_token: Callable[[float], None], out: Outcome,
                       tally: _StreamTally) -> None:
    """Relay one batch of events. Only what must be read is parsed: events until the first token
    (TTFT); a usage is kept as bytes (`_StreamTally`) and, where the gateway asked for it in every
    chunk and the client did not, taken out of each chunk; the last chunk's usage reaches only a
    client that asked for it."""
    keep = []
    for event in batch:
        if out.first_token_at is None:
            obj = event_json(event)
            if isinstance(obj, dict) and has_content(obj):
                out.first_token_at = clock()
                on_first_token(out.first_token_at)
        if _CHOICE in event or _CHOICE_SPACED in event:
            tally.content += 1
        if b'"usage"' in event:
            tally.usage_event = event
            if _is_usage_only(event):
                if not client.last:
                    continue  # we asked for usage; the client did not
            elif strip:
                event = without_usage(event)
        keep.append(event)
    if keep:
        await sink.write(b"".join(keep))


# what a client's connection may have unsent before a write to it is timed: a client that keeps up
# leaves next to nothing there (below the transport's 64 KiB high-water mark, writes never wait)
SLOW_CLIENT_BYTES = 16 * 1024


class ClientSink:
    """A relayed answer's client side. A write to a client that takes nothing of what it was sent
    (its connection's send buffer full) waits at most `send_timeout`: then the client is cut off,
    as gone (`ClientGone`), its connection dropped with what it had not taken. Otherwise a client
    that stops reading would hold its request's permit, and what the gateway buffers of its
    answer, for as long as it likes. Writes to clients that keep up are not timed (no timer a
    chunk)."""

    __slots__ = ("resp", "request", "timeout")

    def __init__(self, resp: web.StreamResponse, request: web.Request, send_timeout: float) -> None:
        self.resp, self.request, self.timeout = resp, request, send_timeout

    def _slow(self, more: int = 0) -> bool:
        transport = self.request.transport
        return transport is not None and transport.get_write_buffer_size() + more > SLOW_CLIENT_BYTES

    async def _timed(self, step: Awaitable[Any], slow: bool) -> None:
        try:
            if slow:
                async with asyncio.timeout(self.timeout):
                    await step
            else:
                await step
        except ConnectionResetError:
            raise ClientGone from None
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            raise ClientGone from None

    async def prepare(self) -> None:
        await self._timed(self.resp.prepare(self.request), False)

    async def write(self, data: bytes) -> None:
        await self._timed(self.resp.write(data), self._slow())

    async def write_eof(self, more: int = 0) -> None:
        """`more`: bytes the end writes (a whole answer's body)."""
        await self._timed(self.resp.write_eof(), self._slow(more))
