"""A lean HTTP/1.1 client for proxying to inference servers.

The gateway's per-request cost is dominated by HTTP work, and a general-purpose client spends
most of its time on features a proxy to a known backend does not need (cookies, redirects,
content negotiation, payload registries). This client does one thing: POST a JSON body over a
pooled keep-alive connection and hand back the status, headers and body as it arrives, parsed by
`httptools` (the C parser uvicorn uses). In `bouncer bench overhead` it raised the gateway's
concurrency-16 throughput from 1,600-2,100 req/s (aiohttp's client) to 2,200-2,850 on this
project's machine.

Closing a response before it completed closes its connection: for a streaming request whose
client went away, that is what makes the engine abort the generation.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator

import httptools
import yarl


class UpstreamError(Exception):
    """The connection failed or the backend broke the protocol."""


class UpstreamTimeout(UpstreamError):
    """No connection, or no data, within the configured time."""


# A kept-alive connection idle longer than this is not reused: the engines' own keep-alive
# (uvicorn's 5 s: vLLM, SGLang) may be closing it as a request goes out on it
IDLE_REUSE_S = 4.0
PEEK_AFTER_S = 0.05  # one idle longer is checked for the backend's FIN before it is reused
# A stream read chunk by chunk holds at most about this much unread before its backend's connection
# stops being read (TCP then holds the rest back, up to the engine): a client that reads slowly,
# or not at all, costs the gateway this much memory, not its whole answer
STREAM_BUFFER_BYTES = 1024 * 1024


class UpstreamResponse:
    """Status and headers once they have arrived; the body as it arrives."""

    __slots__ = ("status", "headers", "_chunks", "_done", "_error", "_waiter", "_conn", "_size", "_limit", "_paused")

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunks: deque[bytes] = deque()
        self._done = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future | None = None
        self._conn: _Connection | None = conn
        self._size = 0  # bytes received and not read yet
        self._limit = 0  # past this many unread, the connection pauses (0: never; a whole answer is read at once)
        self._paused = False

    # -- fed by the connection ---------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._limit and self._size > self._limit and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            if self._conn is not None:
                self._conn.resume()

    def _finish(self) -> None:
        self._done = True
        self._resume()  # the connection goes back to the pool reading
        self._conn = None
        self._wake()

    def _fail(self, exc: Exception) -> None:
        if not self._done:
            self._error = exc
            self._done = True
            self._conn = None
            self._wake()

    @property
    def unread(self) -> int:
        """Bytes of the body received and not read yet."""
        return self._size

    # -- read by the gateway ------------------------------------------------------------------
    async def _wait(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = loop.call_later(timeout, self._timed_out, self._waiter)
        try:
            await self._waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _timed_out(self, waiter: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_exception(UpstreamTimeout("no data from the backend in time"))

    async def chunks(self, read_timeout: float) -> AsyncIterator[bytes]:
        """The body as it arrives; while more than `STREAM_BUFFER_BYTES` of it waits unread, the
        backend's connection is not read."""
        self._limit = STREAM_BUFFER_BYTES
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._size -= len(chunk)
                if self._paused and self._size <= self._limit // 2:
                    self._resume()
                yield chunk
            if self._error is not None:
                raise self._error
            if self._done:
                return
            await self._wait(read_timeout)

    async def read(self, read_timeout: float) -> bytes:
        """The whole body (a short answer has usually all come with its headers)."""
        while not self._done:
            await self._wait(read_timeout)
        if self._error is not None:
            raise self._error
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    def drain(self) -> bytes:
        """What has arrived and was not read yet, without waiting for more."""
        body = b"".join(self._chunks)
        self._chunks.clear()
        self._size = 0
        return body

    def close(self) -> None:
        """Done with it: an unfinished response takes its connection down with it."""
        conn = self._conn
        if conn is not None and not self._done:
            conn.abort()
        self._conn = None


def _no_headers(headers_done: asyncio.Future) -> None:
    if not headers_done.done():
        headers_done.set_exception(UpstreamTimeout("the backend sent no response headers in time"))


class _Connection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool, key: tuple, loop: asyncio.AbstractEventLoop) -> None:
        self.pool = pool
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.headers_done: asyncio.Future | None = None
        self.closed = False
        self.idle_since = 0.0  # when it went back to the pool

    # protocol callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._broken(UpstreamError(f"bad HTTP from the backend: {exc}"))

    def connection_lost(self, exc) -> None:
        self.closed = True
        self._broken(UpstreamError("the backend closed the connection"))
        self.pool._forget(self)

    # parser callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response.status = self.parser.get_status_code()
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        resp, self.response = self.response, None
        keep_alive = self.parser.should_keep_alive()
        if resp is not None:
            resp._finish()
        if keep_alive and not self.closed:
            self.pool._release(self)
        else:
            self.abort()

    # helpers
    def _broken(self, exc: Exception) -> None:
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_exception(exc)
        if self.response is not None:
            self.response._fail(exc)
            self.response = None
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def peer_closed(self) -> bool:
        """Whether the backend has closed its side, its FIN not yet read (an idle connection the
        backend timed out): a request must not go out on it. Peeked on a duplicate of the socket
        (the event loop's own object does not read)."""
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return self.closed
        try:
            with socket.fromfd(sock.fileno(), sock.family, sock.type) as dup:
                return dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read: open
        except OSError:
            return True

    def send(self, head: bytes, body: bytes) -> UpstreamResponse:
        self.parser = httptools.HttpResponseParser(self)
        self.response = UpstreamResponse(self)
        self.headers_done = self.loop.create_future()
        self.transport.writelines((head, body))
        return self.response


class UpstreamPool:
    """Keep-alive connections per backend (scheme, host, port); unbounded, as the core already
    bounds how many requests are in flight per replica. A request goes out once: a POST sent on
    a connection the backend was closing may have reached it, and sent again would run twice, so
    a kept-alive connection is reused only while it is young (`IDLE_REUSE_S`) and not closed on
    the backend's side, and one that fails under a request is that request's failure. A backend
    gone (discovery) leaves nothing behind: its connections close and leave the pool."""

    def __init__(self, connect_timeout: float, read_timeout: float) -> None:
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._idle: dict[tuple, list[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None

    def _release(self, conn: _Connection) -> None:
        conn.idle_since = conn.loop.time()
        self._idle.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        """A connection closed: out of the pool (and its backend's entry, if it was its last)."""
        idle = self._idle.get(conn.key)
        if idle is not None and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.key]

    async def _connect(self, url: yarl.URL, key: tuple) -> _Connection:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            idle_s = conn.loop.time() - conn.idle_since
            # (a connection back in the pool this moment is in use, its backend's FIN not due)
            if not conn.closed and idle_s < IDLE_REUSE_S and (idle_s < PEEK_AFTER_S or not conn.peer_closed()):
                return conn
            conn.abort()
        loop = asyncio.get_running_loop()
        if url.scheme == "https" and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(self, key, loop), url.host, url.port,
                                       ssl=self._ssl if url.scheme == "https" else None),
                self.connect_timeout)
        except TimeoutError:
            raise UpstreamTimeout(f"could not connect to {url.host}:{url.port} in time") from None
        except OSError as exc:
            raise UpstreamError(f"could not connect to {url.host}:{url.port}: {exc}") from None
        return conn

    async def post_json(self, url: yarl.URL, body: bytes, extra_head: str = "") -> UpstreamResponse:
        """Send the request and wait for the status line and headers. `extra_head`: more header
        lines, each ending in CRLF (a trace's `traceparent`)."""
        key = (url.scheme, url.host, url.port)
        head = (f"POST {url.raw_path_qs} HTTP/1.1\r\nHost: {url.raw_authority}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra_head}\r\n").encode("latin-1")
        conn = await self._connect(url, key)
        resp = conn.send(head, body)
        # a timer on the connection's future rather than asyncio.timeout: no task lookups and no
        # cancellation to undo, on every request
        timer = conn.loop.call_later(self.read_timeout, _no_headers, conn.headers_done)
        try:
            await conn.headers_done
            return resp
        except BaseException:
            conn.abort()  # failed, timed out or cancelled (client gone): the request must not run on
            raise
        finally:
            timer.cancel()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
