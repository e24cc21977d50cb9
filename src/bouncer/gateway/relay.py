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

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from aiohttp import web

from bouncer.core.outcomes import Reason, Terminal
from bouncer.gateway.exchange import Outcome
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


def failure_for_status(status: int, headers: dict[str, str], raw: bytes) -> UpstreamFailure | Requeue:
    if status in REFUSAL_STATUSES:
        return Requeue(retry_after_header(headers))
    if 400 <= status < 500:
        message = _backend_message(raw) or f"the backend rejected the request ({status})"
        return UpstreamFailure(400, Reason.UPSTREAM_REJECTED, message)
    return UpstreamFailure(502, Reason.UPSTREAM_ERROR, f"the backend answered {status}")


def completion_tokens(obj: dict[str, Any]) -> int | None:
    """`usage.completion_tokens`, where the backend sent a sensible one."""
    usage = obj.get("usage")
    n = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


def has_content(obj: dict[str, Any]) -> bool:
    """A chunk that carries generated text (its first token, for TTFT)."""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text") or (isinstance(delta, dict) and delta.get("content")):
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


async def sse_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
    """Whole server-sent events (their bytes, blank line included) from an upstream body, in
    batches: the events completed by each chunk received, so they can be relayed in one write."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        batch = []
        while True:
            lf = buf.find(b"\n\n")
            crlf = buf.find(b"\r\n\r\n")
            if lf < 0 and crlf < 0:
                break
            end = lf + 2 if crlf < 0 or 0 <= lf < crlf else crlf + 4
            batch.append(buf[:end])
            buf = buf[end:]
        if batch:
            yield batch
    if buf.strip():
        yield [buf + b"\n\n"]


def error_event(status: int, reason: Reason, message: str) -> bytes:
    err = ApiError(status, message, "api_error", code=reason, layer="upstream", reason=reason)
    return b"data: " + dumps(err.body()) + b"\n\n"


async def relay_json(up: UpstreamResponse, request: web.Request, read_timeout: float, clock: Callable[[], float],
                     on_first_token: Callable[[float], None], out: Outcome) -> web.Response:
    """A non-streaming answer: the whole body, relayed if it is a JSON object. It is written
    here, not by aiohttp once the handler returns, so that the client has it before the
    gateway's bookkeeping (the core told, metrics, the access line) runs: that work is off the
    answer's latency."""
    raw = await up.read(read_timeout)
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise UpstreamFailure(502, Reason.UPSTREAM_ERROR, "the backend's answer is not a JSON object")
    out.first_token_at = clock()
    on_first_token(out.first_token_at)
    out.completion_tokens = completion_tokens(obj) or 0
    out.terminal, out.reason = Terminal.COMPLETED, None  # served, whether or not the client is still there
    resp = web.Response(body=raw, content_type="application/json")
    with contextlib.suppress(ConnectionResetError):
        await resp.prepare(request)
        await resp.write_eof()
    return resp


async def relay_stream(up: UpstreamResponse, request: web.Request, read_timeout: float, client_wants_usage: bool,
                       clock: Callable[[], float], on_first_token: Callable[[float], None],
                       out: Outcome) -> web.StreamResponse:
    """An event stream: its first event is read before the response starts, so a refusal or an
    error there is still a clean HTTP error; then events are relayed as they come."""
    batches = sse_batches(up.chunks(read_timeout))
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
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    content_events = 0
    try:
        try:
            await resp.prepare(request)
        except ConnectionResetError:
            raise ClientGone from None
        try:
            while batch is not None:
                content_events += await _relay_batch(batch, resp, client_wants_usage, clock, on_first_token, out)
                batch = await anext(batches, None)
        except (UpstreamError, TimeoutError) as exc:
            timeout = isinstance(exc, UpstreamTimeout | TimeoutError)
            out.reason = Reason.UPSTREAM_TIMEOUT if timeout else Reason.UPSTREAM_ERROR
            out.completion_tokens = out.completion_tokens or content_events
            await _write(resp, error_event(504 if timeout else 502, out.reason,
                                           f"the backend failed mid-stream: {exc}"))
            await _write_eof(resp)
            return resp
        out.completion_tokens = out.completion_tokens or content_events
        await _write_eof(resp)
        out.terminal, out.reason = Terminal.COMPLETED, None
    except ClientGone:
        # closing the unfinished upstream response (the caller does) makes the engine abort it
        out.terminal, out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
        out.completion_tokens = out.completion_tokens or content_events
    return resp


async def _relay_batch(batch: list[bytes], resp: web.StreamResponse, client_wants_usage: bool,
                       clock: Callable[[], float], on_first_token: Callable[[float], None], out: Outcome) -> int:
    """Relay one batch of events; returns how many carried choices. Only what must be read is
    parsed: events until the first token (TTFT), and those with usage; the rest pass as bytes."""
    keep = []
    content = 0
    for event in batch:
        if out.first_token_at is None or b'"usage"' in event:
            obj = event_json(event)
            if isinstance(obj, dict):
                n = completion_tokens(obj)
                if n is not None:
                    out.completion_tokens = n
                    if not client_wants_usage and not obj.get("choices"):
                        continue  # we asked for usage; the client did not
                if out.first_token_at is None and has_content(obj):
                    out.first_token_at = clock()
                    on_first_token(out.first_token_at)
        if b'"choices":[{' in event or b'"choices": [{' in event:
            content += 1
        keep.append(event)
    if keep:
        await _write(resp, b"".join(keep))
    return content


async def _write(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionResetError:
        raise ClientGone from None


async def _write_eof(resp: web.StreamResponse) -> None:
    try:
        await resp.write_eof()
    except ConnectionResetError:
        raise ClientGone from None
