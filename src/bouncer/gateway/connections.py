"""The gateway's client connections: bounded in number and in how long a slow client may hold one.

aiohttp's server has a keep-alive timeout but no deadline for a request's headers (a client can
trickle them for as long as the keep-alive lasts) and no connection cap, and it answers a
malformed request with a text page and a logged traceback. So each connection here is an
aiohttp `RequestHandler` that also:
- closes with 408 a connection whose request line and headers have not all arrived within
  `header_timeout_s` of the request's first byte (the body has its own deadline, in the handler);
- answers 503 `too_many_connections` and closes, past `max_connections` open connections;
- answers a request it could not parse with an OpenAI error body, and logs one line (rate-limited
  by `bouncer.gateway.logs`), not a traceback.

Whether a request is being handled is told by the app's middleware (`request_started` /
`request_finished`): a handler runs only once aiohttp has parsed the request's headers.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

from aiohttp import web, web_protocol

from bouncer.openai_wire import ApiError, dumps

log = logging.getLogger("bouncer.gateway")


def raw_error(status: int, phrase: str, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, for where no handler runs."""
    body = dumps(ApiError(status, message, "invalid_request_error" if status < 500 else "overloaded_error",
                          code=reason, layer="validation" if status < 500 else "queue", reason=reason).body())
    retry = b"Retry-After: 1\r\n" if status >= 500 else b""
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\n".encode() + retry
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)


class Limits:
    """What the connections of one server share: the settings, and how many are open."""

    def __init__(self, header_timeout_s: float, max_connections: int) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.open = 0
        self.refused = 0  # over the cap
        self.header_timeouts = 0


class GuardedRequestHandler(web_protocol.RequestHandler):
    """aiohttp's per-connection protocol with a header deadline, a cap, and JSON error pages."""

    def __init__(self, manager: web.Server, limits: Limits, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._counted = False
        self._handling = 0  # requests of this connection in a handler now
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        limits = self._limits
        if limits.open >= limits.max_connections:
            limits.refused += 1
            transport.write(raw_error(503, "Service Unavailable", "too_many_connections",  # type: ignore[attr-defined]
                                      f"the gateway holds {limits.max_connections} connections already"))
            transport.close()
            return
        limits.open += 1
        self._counted = True
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._limits.open -= 1
            self._counted = False
        self._cancel_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # Bytes that arrive while a request is in a handler are its body (which has its own
        # deadline) or a pipelined request, which cannot be told apart here; so the clock starts
        # at the first byte that arrives while none is handled. A pipelined request's headers
        # left incomplete are then cut by the keep-alive timeout, or by this deadline at its
        # next byte.
        if not self._handling and self._header_timer is None:
            self._arm_header_timer()
        super().data_received(data)

    # told by the middleware
    def request_started(self) -> None:
        self._handling += 1
        self._cancel_header_timer()

    def request_finished(self) -> None:
        self._handling -= 1

    def _arm_header_timer(self) -> None:
        self._header_timer = self._loop.call_later(self._limits.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self._handling or self.transport is None:
            return
        self._limits.header_timeouts += 1
        self.transport.write(raw_error(408, "Request Timeout", "request_timeout",
                                       f"the request's headers did not arrive within "
                                       f"{self._limits.header_timeout_s:g} s"))
        self.force_close()  # closes the transport too

    def handle_error(self, request, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (or a handler that raised): an
        OpenAI error body, and one log line without a traceback."""
        what = str(message or exc or status).strip().splitlines()[0][:200]
        log.info("bad request from %s: %s", request.remote, what, extra={"event": "bad_http_request", "status": status})
        reason = "invalid_request" if status < 500 else "internal_error"
        err = ApiError(status, message or ("bad HTTP request" if status < 500 else "internal error"),
                       "invalid_request_error" if status < 500 else "api_error", code=reason,
                       layer="validation", reason=reason)
        resp = web.Response(status=status, body=dumps(err.body()), content_type="application/json")
        resp.force_close()
        return resp


class GuardedSite(web.BaseSite):
    """A TCP site whose connections are `GuardedRequestHandler`s."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, limits: Limits, *,
                 handler_kwargs: dict, backlog: int = 1024) -> None:
        super().__init__(runner, backlog=backlog)
        self._host, self._port = host, port
        self.limits = limits
        self._handler_kwargs = handler_kwargs

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        factory: Callable[[], GuardedRequestHandler] = lambda: GuardedRequestHandler(  # noqa: E731
            server, self.limits, loop=loop, **self._handler_kwargs)
        self._server = await loop.create_server(factory, self._host, self._port, backlog=self._backlog,
                                                reuse_address=True, family=socket.AF_INET)
