"""The HTTP proxy front: an OpenAI-compatible server that relays each admitted request's answer.

Per request: read the body (within `listen.body_timeout_s`), have the control plane check and
admit it (queued requests wait there and leave the queue if the client disconnects), then relay
the chosen replica's answer (`relay.py`) and tell the control plane how it ended.

Admission happens before the first byte: a streaming response starts (200 and the event stream)
only once the upstream has produced its first event, so a refusal, including vLLM's refusal sent
as HTTP 200 with an error event, is always a clean HTTP error with Retry-After. A replica that
refuses for load before anything reached the client has its request held again (`Requeue`).

The proxy sees every byte, so it sees everything the control plane learns from: the first
token, the usage, the end, the client leaving.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
import yarl
from aiohttp import web

from bouncer.core.journey import Outcome
from bouncer.core.outcomes import Dispatch, Divert, Layer, Reason, Refusal, Terminal
from bouncer.gateway.control_plane import ControlPlane, serve_http
from bouncer.gateway.disaggregated import kv_transfer_params, prefill_body
from bouncer.gateway.errors import error_response
from bouncer.gateway.parsed_request import Exchange
from bouncer.gateway.relay import (
    ClientUsage,
    Requeue,
    Timeouts,
    UpstreamFailure,
    answer_json,
    failure_for_status,
    read_usage,
    relay_json,
    relay_stream,
)
from bouncer.gateway.upstream import UpstreamError, UpstreamPool, UpstreamTimeout
from bouncer.gateway.upstream_body import USAGE_EVERY_CHUNK, upstream_body
from bouncer.openai_wire import dumps

if TYPE_CHECKING:
    from opentelemetry.trace import Span  # only where tracing is configured (gateway/tracing.py)

UPSTREAM_CONNECT_TIMEOUT_S = 5.0
UPSTREAM_READ_TIMEOUT_S = 300.0  # silence on an upstream stream this long is a timeout
URLS_KEPT = 4096  # parsed upstream URLs (replica x path) kept


class Proxy:
    def __init__(self, plane: ControlPlane, read_timeout_s: float = UPSTREAM_READ_TIMEOUT_S) -> None:
        self.plane = plane
        self.clock = plane.clock
        self.upstream = UpstreamPool(UPSTREAM_CONNECT_TIMEOUT_S, read_timeout_s)
        self._urls: dict[tuple[str, str], yarl.URL] = {}

    def app(self) -> web.Application:
        app = self.plane.http_app()
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_cleanup.append(self._stop)
        return app

    async def _stop(self, _app: web.Application) -> None:
        self.upstream.close()

    # -- OpenAI endpoints --------------------------------------------------------------------------
    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", "/v1/chat/completions")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion", "/v1/completions")

    async def _generate(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        ex = self.plane.open_exchange(path, headers=request.headers, kind=kind)
        resp: web.StreamResponse | None = None
        try:
            resp = await self._generate_for(request, kind, path, ex)
            if not resp.prepared and ex.line["tenant"] != "-":  # a refusal, to a known tenant
                resp.headers.update(self.plane.ratelimit_headers(ex.line["tenant"]))
            return resp
        finally:
            self.plane.close_exchange(ex, resp.status if resp is not None else None)

    async def _generate_for(self, request: web.Request, kind: str, path: str, ex: Exchange) -> web.StreamResponse:
        plane = self.plane
        limits = plane.config.limits
        too_large = Refusal(Layer.VALIDATION, Reason.BODY_TOO_LARGE,
                            f"request body exceeds {limits.max_body_bytes} bytes")
        if (refusal := plane.unauthenticated(ex, request.headers)) is not None:
            return error_response(refusal)
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            return error_response(plane.refuse_early(ex, too_large))
        try:
            if request.content.is_eof():  # the whole body came with the headers: nothing to wait for
                raw: bytes | None = await request.read()
            else:
                async with asyncio.timeout(plane.config.listen.body_timeout_s):  # no task per request (wait_for)
                    raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # past the app's client_max_size of limit + 1
            raw = None
        except TimeoutError:
            return error_response(plane.refuse_early(ex, Refusal(
                Layer.VALIDATION, Reason.REQUEST_TIMEOUT,
                f"the request body did not arrive within {plane.config.listen.body_timeout_s:g} s")))
        if raw is None or len(raw) > limits.max_body_bytes:
            return error_response(plane.refuse_early(ex, too_large))
        parsed = plane.parse(ex, kind, raw, request.headers)
        if isinstance(parsed, Refusal):
            return error_response(parsed)
        decision = await plane.admit(ex, parsed)
        if isinstance(decision, Divert):
            return await self._serve_overflow(request, path, parsed.head.model, parsed.body, decision, ex)
        while True:
            if isinstance(decision, Refusal):
                return error_response(decision)
            result = await self._serve_admitted(request, kind, path, parsed.body, decision, ex)
            if not isinstance(result, Requeue):
                return result
            decision = await plane.requeue(ex, result.retry_after)

    async def _serve_admitted(self, request: web.Request, kind: str, path: str, body: dict[str, Any], d: Dispatch,
                              ex: Exchange) -> web.StreamResponse | Requeue:
        """Send an admitted request upstream and relay the answer. Owns its permit: whatever
        happens here, the control plane hears how it ended (or gets it back to hold again, on
        `Requeue`)."""
        plane, line, root = self.plane, ex.line, ex.span
        rid = d.request_id
        out = Outcome()
        requeued = False
        streaming = bool(body.get("stream"))
        span: Span | None = None
        up_status: int | None = None
        first_at: list[float] = []  # when the first token came (a traced request's first-token span)
        dispatched = self.clock()
        try:
            model = plane.prepared.models[d.model]
            url = plane.replica_url(d.replica)
            every_chunk = model.engine in USAGE_EVERY_CHUNK  # what it used so far, known wherever it stops
            sent, dropped = upstream_body(body, model.upstream_model or model.name, d.max_tokens, usage=True,
                                          usage_every_chunk=every_chunk, cache_salt=d.cache_salt)
            if dropped:
                line["dropped"] = ",".join(dropped)

            def first_token(at: float) -> None:
                # a stream's first token is measured; a whole answer only says its prefill is over
                plane.started(rid, at, measured=streaming)
                if root is not None:
                    first_at.append(at)

            read_timeout = self.upstream.read_timeout
            if d.decode_replica is not None:  # disaggregated: the prompt first, on the prefill worker
                url = await self._prefill(rid, url, path, sent, d.decode_replica)
            trace_head = ""
            if root is not None:
                span, trace_head = plane.tracer.upstream(  # type: ignore[union-attr]
                    root, kind, sent["model"], url, d.replica, dispatched)
            up = await self.upstream.post_json(self._upstream_url(url, path), dumps(sent), trace_head)
            up_status = up.status
            try:
                if up.status != 200:
                    raise failure_for_status(up.status, up.headers, await up.read(read_timeout))
                headers = plane.ratelimit_headers(d.tenant)
                if streaming:
                    return await relay_stream(up, request, self._timeouts(), ClientUsage.of(body), every_chunk,
                                              self.clock, first_token, out, headers)
                return await relay_json(up, request, self._timeouts(), self.clock, first_token, out, headers)
            finally:
                up.close()  # an unfinished response takes its connection down: the engine aborts it
        except Requeue as exc:
            requeued = True
            return exc
        except UpstreamFailure as exc:
            out.reason = exc.reason
            return error_response(Refusal(Layer.UPSTREAM, exc.reason, exc.message, exc.retry_after))
        except UpstreamTimeout:
            out.reason = Reason.UPSTREAM_TIMEOUT
            return error_response(Refusal(Layer.UPSTREAM, out.reason, "the backend timed out", 1.0))
        except UpstreamError as exc:
            out.reason = Reason.UPSTREAM_ERROR
            line["upstream_error"] = str(exc)  # the operator's to read: it names the replica's address
            return error_response(Refusal(Layer.UPSTREAM, out.reason, "the backend could not be reached", 1.0))
        except (asyncio.CancelledError, ConnectionResetError):
            out.terminal, out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
            raise
        finally:
            if not requeued:
                plane.finish(ex, d, out, streaming)
            if span is not None:
                plane.tracer.end_upstream(  # type: ignore[union-attr]
                    span, dispatched, first_at[0] if first_at else None, up_status, self.clock())

    async def _serve_overflow(self, request: web.Request, path: str, model: str, body: dict[str, Any], d: Divert,
                              ex: Exchange) -> web.StreamResponse:
        """Relay a diverted request to its external overflow endpoint (`OverflowTarget`), with that
        endpoint's key and model name; its usage is settled at its price. Refused there for load
        (429, 503): the client gets the refusal the pool would have given."""
        plane, line = self.plane, ex.line
        target = plane.overflow_target(model, d.target)
        out = Outcome()
        streaming = bool(body.get("stream"))
        # the tenant's token limit holds at the provider too; what steers an engine goes nowhere
        sent, dropped = upstream_body(body, target.upstream_model or model, d.max_tokens, usage=True)
        if dropped:
            line["dropped"] = ",".join(dropped)
        key = os.environ.get(target.api_key_env) if target.api_key_env else None
        auth = f"Authorization: Bearer {key}\r\n" if key else ""
        url = self._upstream_url(target.url.rstrip("/"), path)  # type: ignore[union-attr]
        finished_later = False
        try:
            if not streaming:
                # a whole answer the provider computes (and bills) to its end whether its client
                # waits or not: fetched in a task of its own, which a client that leaves leaves
                # running, to be settled at the usage the provider reports
                fetch = asyncio.ensure_future(self._fetch_whole(url, dumps(sent), auth))
                try:
                    status, headers, raw = await asyncio.shield(fetch)
                except asyncio.CancelledError:
                    finished_later = True
                    plane.background(self._finish_overflow_later(fetch, d, model, out, ex))
                    raise
                if status != 200:
                    raise failure_for_status(status, headers, raw)
                return await answer_json(raw, request, self._timeouts().send, self.clock, _ignore, out,
                                         plane.ratelimit_headers(d.tenant))
            up = await self.upstream.post_json(url, dumps(sent), auth)
            try:
                if up.status != 200:
                    raise failure_for_status(up.status, up.headers, await up.read(self.upstream.read_timeout))
                return await relay_stream(up, request, self._timeouts(), ClientUsage.of(body), False,
                                          self.clock, _ignore, out, plane.ratelimit_headers(d.tenant))
            finally:
                up.close()
        except Requeue:
            out.reason = Reason.UPSTREAM_REFUSED
            return error_response(d.refusal)
        except UpstreamFailure as exc:
            # a provider's own words are the operator's (its account, its limits), not the client's
            out.reason = exc.reason
            line["upstream_error"] = exc.message
            what = "rejected the request" if exc.reason is Reason.UPSTREAM_REJECTED else "failed"
            return error_response(Refusal(Layer.UPSTREAM, exc.reason, f"the overflow endpoint {what}",
                                          exc.retry_after))
        except UpstreamError as exc:
            out.reason = Reason.UPSTREAM_TIMEOUT if isinstance(exc, UpstreamTimeout) else Reason.UPSTREAM_ERROR
            line["upstream_error"] = str(exc)
            return error_response(Refusal(Layer.UPSTREAM, out.reason, "the overflow endpoint could not be reached",
                                          1.0))
        except (asyncio.CancelledError, ConnectionResetError):
            out.terminal, out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
            raise
        finally:
            if not finished_later:
                plane.finish_diverted(ex, d, model, out)

    async def _fetch_whole(self, url: yarl.URL, body: bytes, auth: str) -> tuple[int, dict[str, str], bytes]:
        up = await self.upstream.post_json(url, body, auth)
        try:
            return up.status, up.headers, await up.read(self.upstream.read_timeout)
        finally:
            up.close()

    async def _finish_overflow_later(self, fetch: asyncio.Future, d: Divert, model: str, out: Outcome,
                                     ex: Exchange) -> None:
        """A whole overflow answer its client left: settled at its usage once it came."""
        try:
            status, _, raw = await fetch
            if status == 200:
                out.first_token_at = self.clock()  # its answer came (to no one): what it reports was used
                if not read_usage(orjson.loads(raw), out):
                    out.completion_tokens = 0
        except (UpstreamError, orjson.JSONDecodeError):
            out.completion_tokens = None  # not known: charged what it reserved
        except asyncio.CancelledError:  # the gateway stops: charged what it reserved
            fetch.cancel()
            out.completion_tokens = None
        finally:
            self.plane.finish_diverted(ex, d, model, out)

    async def _prefill(self, rid: str, url: str, path: str, sent: dict[str, Any], decode: str) -> str:
        """The P/D hop (`bouncer.gateway.disaggregated`): the prompt on the prefill worker at
        `url`; then the request is the decode worker's, whose URL is returned, and `sent`
        carries where its KV waits."""
        up = await self.upstream.post_json(self._upstream_url(url, path), dumps(prefill_body(sent)))
        try:
            params = await kv_transfer_params(up, self.upstream.read_timeout)
        finally:
            up.close()
        self.plane.handed_over(rid)
        sent["kv_transfer_params"] = params
        return self.plane.replica_url(decode)

    def _timeouts(self) -> Timeouts:
        return Timeouts(self.upstream.read_timeout, self.plane.config.listen.send_timeout_s)

    def _upstream_url(self, base: str, path: str) -> yarl.URL:
        """Parsed once per backend and path: URL parsing is a visible cost per request."""
        url = self._urls.get((base, path))
        if url is None:
            if len(self._urls) >= URLS_KEPT:  # replicas come and go (discovery): start over
                self._urls.clear()
            url = self._urls[(base, path)] = yarl.URL(base + path)
        return url

    async def handle_models(self, request: web.Request) -> web.Response:
        status, body = self.plane.models_answer(request.headers)
        return web.Response(status=status, body=body, content_type="application/json")


def _ignore(_at: float) -> None:
    """An overflow endpoint's first token: nothing in the core waits for it."""


async def serve_proxy(plane: ControlPlane, host: str, port: int, ready: asyncio.Event | None = None,
                      on_listening: Callable[[], None] | None = None, proxy: Proxy | None = None) -> None:
    """The proxy front and the control plane's endpoints on one HTTP port, until cancelled."""
    await serve_http(plane, (proxy or Proxy(plane)).app(), host, port, ready, on_listening)

