"""The asyncio gateway: an OpenAI-compatible HTTP shell around the admission core.

Per request: read and parse the body, tokenize, offer to the core, await its decision (queued
requests wait here, and leave the queue if the client disconnects), then proxy to the chosen
replica and report the outcome back. Nothing policy-shaped lives here.

Admission happens before the first byte: a streaming response starts (200 and the event stream)
only once the upstream has produced its first event, so a refusal, including vLLM's refusal sent
as HTTP 200 with an error event, is always a clean HTTP error with Retry-After.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import yaml
import yarl
from aiohttp import web
from prometheus_client import generate_latest

from bouncer.config import BouncerConfig, ConfigError, key_digest, load_config, parse_config
from bouncer.core.admission import AdmissionCore, Dispatch, Event, Reject, backend_name
from bouncer.core.fleet import Telemetry
from bouncer.core.outcomes import Layer, Refusal, Terminal
from bouncer.gateway import kv_events
from bouncer.gateway.metrics import GatewayMetrics
from bouncer.gateway.request_parsing import request_info
from bouncer.gateway.scrapers import PARSERS
from bouncer.gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse, UpstreamTimeout
from bouncer.openai_wire import ApiError, dumps, models_list, parse_json_object
from bouncer.tokenizer import PromptTokenizer

log = logging.getLogger("bouncer.gateway")

TICK_MIN_S = 0.005
TICK_MAX_S = 0.1  # the core's TTL deadlines are checked at least this often
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
UPSTREAM_READ_TIMEOUT_S = 300.0  # silence on an upstream stream this long is a timeout
TOKENIZE_IN_THREAD_BYTES = 32 * 1024  # bodies larger than this are tokenized off the event loop


_REQUEUED = web.Response(status=503)  # sentinel: the upstream refused, hold the request again


class _ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


class _Upstream(Exception):
    """The upstream refused or failed before the response to the client started."""

    def __init__(self, status: int, reason: str, message: str, body: bytes | None = None,
                 retry_after: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.message = message
        self.body = body
        self.retry_after = retry_after


def _refusal_response(refusal: Refusal) -> web.Response:
    err = ApiError(refusal.status, refusal.message, refusal.error_type, code=refusal.reason, param=refusal.param,
                   layer=refusal.layer.value, reason=refusal.reason)
    headers = {"x-bouncer-layer": refusal.layer.value, "x-bouncer-reason": refusal.reason}
    if refusal.retry_after is not None:
        # whole seconds by the standard; milliseconds for clients that read them (OpenAI SDKs)
        headers["Retry-After"] = str(max(1, math.ceil(refusal.retry_after)))
        headers["retry-after-ms"] = str(int(refusal.retry_after * 1000))
    return web.Response(status=refusal.status, body=dumps(err.body()), content_type="application/json",
                        headers=headers)


class Gateway:
    def __init__(self, config: BouncerConfig, *, config_path: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.config_path = config_path
        self.core = AdmissionCore(config, clock())
        self.metrics = GatewayMetrics(lambda: self.core, clock, lambda: self.kv_event_stats)
        self._apply_config(config)
        self._ids = itertools.count()
        self._waiters: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._scrapers: dict[str, asyncio.Task] = {}
        # KV-event subscriptions: replica -> ((endpoint, topic), task), and their counters
        self._kv_subs: dict[str, tuple[tuple[str, str], asyncio.Task]] = {}
        self.kv_event_stats: dict[str, kv_events.SubscriberStats] = {}
        self._zmq: kv_events.zmq.asyncio.Context | None = None
        self.session: aiohttp.ClientSession | None = None  # scrapes
        self.upstream = UpstreamPool(UPSTREAM_CONNECT_TIMEOUT_S, UPSTREAM_READ_TIMEOUT_S)  # proxied requests
        self._urls: dict[tuple[str, str], yarl.URL] = {}

    def _apply_config(self, config: BouncerConfig) -> None:
        self.config = config
        self._admin_keys = set(config.admin_keys_sha256)
        self._tokenizers: dict[str, PromptTokenizer | None] = {}
        for m in config.models:
            self._tokenizers[m.name] = PromptTokenizer(m.tokenizer) if m.tokenizer else None
        self._models = {m.name: m for m in config.models}

    # -- lifecycle ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.limits.max_body_bytes + 1)
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", self.handle_ready)
        app.router.add_get("/metrics", self.handle_metrics)
        app.router.add_get("/admin/state", self.handle_admin_state)
        app.router.add_post("/admin/drain", self.handle_admin_drain)
        app.router.add_post("/admin/undrain", self.handle_admin_undrain)
        app.router.add_post("/admin/reload", self.handle_admin_reload)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, json_serialize=lambda o: dumps(o).decode(),
                                             timeout=aiohttp.ClientTimeout(total=None))
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._ticker()))
        self._sync_scrapers()

    async def _stop(self, _app: web.Application) -> None:
        subs = [task for _, task in self._kv_subs.values()]
        for task in [*self._tasks, *self._scrapers.values(), *subs]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._scrapers.values(), *subs, return_exceptions=True)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)  # closes any subscriber socket left, then terminates
        if self.session is not None:
            await self.session.close()
        self.upstream.close()

    def _sync_scrapers(self) -> None:
        loop = asyncio.get_running_loop()
        live = {name for name, r in self.core.replicas.items() if not r.removed}
        for name in list(self._scrapers):
            if name not in live:
                self._scrapers.pop(name).cancel()
        for name in live:
            if name not in self._scrapers:
                self._scrapers[name] = loop.create_task(self._scrape_loop(name))
        self._sync_kv_subscriptions(live)

    def _sync_kv_subscriptions(self, live: set[str]) -> None:
        """One subscriber per live replica whose backend names a KV-event endpoint."""
        wanted = {backend_name(m.name, i, b.name): (b.kv_events, b.kv_events_topic)
                  for m in self.config.models for i, b in enumerate(m.backends) if b.kv_events}
        for name, (where, task) in list(self._kv_subs.items()):
            if name not in live or wanted.get(name) != where:
                task.cancel()
                del self._kv_subs[name]
        for name, where in wanted.items():
            if name in live and name not in self._kv_subs:
                if self._zmq is None:
                    self._zmq = kv_events.zmq.asyncio.Context()
                stats = self.kv_event_stats.setdefault(name, kv_events.SubscriberStats())

                def deliver(events, name=name):
                    self.core.kv_events(name, events, self.clock())
                task = asyncio.get_running_loop().create_task(
                    kv_events.subscribe(where[0], where[1], deliver, stats, self._zmq))
                self._kv_subs[name] = (where, task)

    # -- core events -------------------------------------------------------------------------------
    def _apply(self, events: list[Event]) -> None:
        for event in events:
            rid = event.adm.request_id if isinstance(event, Dispatch) else event.request_id
            fut = self._waiters.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(event)
            elif isinstance(event, Dispatch):
                # its client is gone already: give the permit straight back
                self._apply(self.core.finished(rid, self.clock(), Terminal.CANCELLED))

    async def _ticker(self) -> None:
        while True:
            wake = self.core.next_wakeup()
            delay = TICK_MAX_S if wake is None else min(TICK_MAX_S, max(TICK_MIN_S, wake - self.clock()))
            await asyncio.sleep(delay)
            self._apply(self.core.tick(self.clock()))

    async def _scrape_loop(self, name: str) -> None:
        interval = self.config.policy.telemetry.scrape_interval_s
        while True:
            replica = self.core.replicas[name]
            model = self._models[replica.model]
            at = self.clock()
            telemetry: Telemetry | None
            try:
                telemetry = await self._scrape(replica.url, model.engine, replica.configured_blocks, at,
                                               timeout=max(1.0, 4 * interval))
            except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
                log.debug("scrape of %s failed: %s", name, exc)
                telemetry = None
            self._apply(self.core.observe(name, telemetry, self.clock()))
            await asyncio.sleep(max(0.0, at + interval - self.clock()))

    async def _scrape(self, url: str, engine: str, blocks: int | None, at: float, timeout: float) -> Telemetry:
        t = aiohttp.ClientTimeout(total=timeout)
        if engine == "openai":  # no metrics: a liveness probe, load comes from our own accounting
            async with self.session.get(url + "/v1/models", timeout=t) as resp:
                resp.raise_for_status()
            return Telemetry(at=at, kv_usage=0.0, running=0, waiting=0)
        async with self.session.get(url + "/metrics", timeout=t) as resp:
            resp.raise_for_status()
            text = await resp.text()
        return PARSERS[engine](text, at, blocks)

    # -- OpenAI endpoints --------------------------------------------------------------------------
    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", "/v1/chat/completions")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion", "/v1/completions")

    def _refuse_early(self, rid: str, err: ApiError, reason: str) -> web.Response:
        refusal = Refusal(Layer.VALIDATION, reason, err.message, param=err.param)
        self.core.record_refusal(rid, refusal)
        return _refusal_response(refusal)

    async def _generate(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        rid = f"bq-{next(self._ids)}"
        limit = self.config.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return self._refuse_early(rid, ApiError(413, f"request body exceeds {limit} bytes"), "body_too_large")
        try:
            raw: bytes | None = await request.read()  # all of it (StreamReader.read(n) may return less)
        except web.HTTPRequestEntityTooLarge:  # past the app's client_max_size of limit + 1
            raw = None
        if raw is None or len(raw) > limit:
            return self._refuse_early(rid, ApiError(413, f"request body exceeds {limit} bytes"), "body_too_large")
        try:
            body = parse_json_object(raw)
            model = self._models.get(body.get("model")) if isinstance(body.get("model"), str) else None
            tokenizer = self._tokenizers.get(model.name) if model else None
            block_size = model.block_size if model else 16
            if len(raw) > TOKENIZE_IN_THREAD_BYTES:
                # ~1 us per token: a long prompt would stall every other request on the loop
                info = await asyncio.to_thread(request_info, rid, kind, body, request.headers, tokenizer, block_size)
            else:
                info = request_info(rid, kind, body, request.headers, tokenizer, block_size)
        except ApiError as err:
            return self._refuse_early(rid, err, "invalid_request" if err.code == "invalid_json" else
                                      "invalid_parameter")
        decision = await self._decision(rid, lambda: self.core.offer(info, self.clock()))
        while True:
            if isinstance(decision, Reject):
                return _refusal_response(decision.refusal)
            adm = decision.adm
            self.metrics.observe_queue_wait(adm.tenant, adm.priority, adm.dispatched_at - adm.arrival)
            result = await self._proxy(request, kind, path, body, decision)
            if result is not _REQUEUED:
                return result
            # the replica refused it: the core holds it again until it fits elsewhere or expires
            decision = await self._decision(rid, lambda: self.core.requeue(rid, self.clock()))

    async def _decision(self, rid: str, call: Callable[[], list[Event]]) -> Event:
        """Run a core call and wait for this request's decision; a client that goes away while
        its request is queued takes it out of the queue."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        self._apply(call())
        try:
            return await fut
        except asyncio.CancelledError:
            self._waiters.pop(rid, None)
            self._apply(self.core.cancel(rid, self.clock()))
            raise

    async def _proxy(self, request: web.Request, kind: str, path: str, body: dict[str, Any],
                     decision: Dispatch) -> web.StreamResponse:
        """Send an admitted request upstream and relay the answer. Returns `_REQUEUED` when the
        replica refused it before anything reached the client."""
        adm = decision.adm
        rid = adm.request_id
        model = self._models[adm.info.model]
        replica = self.core.replicas[adm.replica]
        upstream_body = dict(body)
        upstream_body["model"] = model.upstream_model or model.name
        upstream_body["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = adm.max_tokens
        streaming = bool(body.get("stream"))
        client_wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if streaming:
            upstream_body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        terminal: Terminal | None = Terminal.FAILED
        reason, completion = "upstream_error", 0
        first_token_at: float | None = None
        resp: web.StreamResponse | None = None
        up: UpstreamResponse | None = None
        read_timeout = self.upstream.read_timeout
        try:
            up = await self.upstream.post_json(self._upstream_url(replica.url, path), dumps(upstream_body))
            if up.status != 200:
                raw = await up.read(read_timeout)
                if up.status in (429, 503, 529):
                    raise _Upstream(503, "upstream_refused", f"the backend refused the request ({up.status})",
                                    retry_after=up.headers.get("retry-after"))
                raise _Upstream(up.status, "upstream_error", f"the backend answered {up.status}", body=raw)
            if not streaming:
                raw = await up.read(read_timeout)
                first_token_at = self.clock()
                self.core.started(rid, first_token_at)
                try:
                    completion = int(orjson.loads(raw).get("usage", {}).get("completion_tokens", 0))
                except (orjson.JSONDecodeError, AttributeError, TypeError, ValueError):
                    completion = 0
                terminal, reason = Terminal.COMPLETED, None
                return web.Response(body=raw, content_type="application/json")
            batches = _sse_batches(up.chunks(read_timeout))
            batch = await anext(batches, None)
            if not batch:
                raise _Upstream(502, "upstream_error", "the backend closed the stream without an event")
            first_obj = _event_json(batch[0])
            if isinstance(first_obj, dict) and "error" in first_obj:
                # vLLM refuses some streams as HTTP 200 whose first event is an error
                code = (first_obj.get("error") or {}).get("code")
                if code in (429, 503, "429", "503"):
                    raise _Upstream(503, "upstream_refused", "the backend refused the request in-stream")
                raise _Upstream(502, "upstream_error", "the backend sent an error event", body=dumps(first_obj))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            try:
                await resp.prepare(request)
            except ConnectionResetError:
                raise _ClientGone from None
            content_events = 0
            while batch is not None:
                out = []
                for event in batch:
                    # Parse only what must be read: events until the first token (TTFT), and the
                    # usage event; the rest are relayed as bytes.
                    if first_token_at is None or b'"usage"' in event:
                        obj = _event_json(event)
                        if isinstance(obj, dict):
                            if obj.get("usage"):
                                completion = int(obj["usage"].get("completion_tokens", 0))
                                if not client_wants_usage and not obj.get("choices"):
                                    continue  # we asked for usage; the client did not
                            if first_token_at is None and _has_content(obj):
                                first_token_at = self.clock()
                                self.core.started(rid, first_token_at)
                    if b'"choices":[{' in event or b'"choices": [{' in event:
                        content_events += 1
                    out.append(event)
                if out:
                    try:
                        await resp.write(b"".join(out))
                    except ConnectionResetError:
                        raise _ClientGone from None
                batch = await anext(batches, None)
            completion = completion or content_events
            try:
                await resp.write_eof()
            except ConnectionResetError:
                raise _ClientGone from None
            terminal, reason = Terminal.COMPLETED, None
            return resp
        except _ClientGone:
            # the client left mid-stream: closing the unfinished upstream response (below)
            # closes its connection, which makes the engine abort the request
            terminal, reason = Terminal.CANCELLED, "client_disconnected"
            return resp
        except _Upstream as exc:
            reason = exc.reason
            if resp is None and exc.reason == "upstream_refused":
                terminal = None  # not over: it goes back to the queue
                return _REQUEUED
            if resp is None:
                if exc.body is not None:
                    return web.Response(status=exc.status, body=exc.body, content_type="application/json")
                retry = exc.retry_after if exc.retry_after and exc.retry_after.isdigit() else None
                refusal = Refusal(Layer.UPSTREAM, exc.reason, exc.message,
                                  float(retry) if retry else self.core.retry_after(
                                      self.core.models[adm.info.model], adm.priority, self.clock()))
                return _refusal_response(refusal)
            raise
        except UpstreamTimeout:
            reason = "upstream_timeout"
            if resp is None:
                return _refusal_response(Refusal(Layer.UPSTREAM, reason, "the backend timed out", 1.0))
            raise
        except UpstreamError as exc:
            reason = "upstream_error"
            if resp is None:
                return _refusal_response(Refusal(Layer.UPSTREAM, reason, f"backend connection failed: {exc}", 1.0))
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            terminal, reason = Terminal.CANCELLED, "client_disconnected"
            raise
        finally:
            if up is not None:
                up.close()
            now = self.clock()
            if terminal is Terminal.COMPLETED:
                tpot = (now - first_token_at) / (completion - 1) \
                    if first_token_at is not None and completion > 1 and streaming else None
                self.metrics.observe_completed(adm.tenant, adm.arrival, first_token_at, tpot, now)
            if terminal is not None:
                self._apply(self.core.finished(rid, now, terminal, completion, reason))

    def _upstream_url(self, base: str, path: str) -> yarl.URL:
        """Parsed once per backend and path: URL parsing is a visible cost per request."""
        url = self._urls.get((base, path))
        if url is None:
            url = self._urls[(base, path)] = yarl.URL(base + path)
        return url

    async def handle_models(self, _request: web.Request) -> web.Response:
        return web.Response(body=dumps(models_list(list(self._models))), content_type="application/json")

    async def handle_health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, _request: web.Request) -> web.Response:
        snap = self.core.snapshot(self.clock())
        ready = {name: any(r["healthy"] and r["fresh"] and not r["removed"] for r in m["replicas"].values())
                 for name, m in snap["models"].items()}
        status = 200 if all(ready.values()) else 503
        return web.json_response({"ready": status == 200, "models": ready}, status=status)

    async def handle_metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # -- admin -------------------------------------------------------------------------------------
    def _admin_denied(self, request: web.Request) -> web.Response | None:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not self._admin_keys:
            return web.json_response({"error": {"message": "admin endpoints are disabled (no admin_keys_sha256)",
                                                "type": "permission_error"}}, status=403)
        if not key or key_digest(key) not in self._admin_keys:
            return web.json_response({"error": {"message": "admin key required", "type": "authentication_error"}},
                                     status=401)
        return None

    async def _model_from(self, request: web.Request) -> str:
        model = request.query.get("model")
        if model is None and request.can_read_body:
            try:
                model = (await request.json()).get("model")
            except (ValueError, AttributeError):
                model = None
        if model not in self._models:
            raise web.HTTPNotFound(text=f"unknown model {model!r}")
        return model

    async def handle_admin_state(self, request: web.Request) -> web.Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        return web.Response(body=dumps(self.core.snapshot(self.clock())), content_type="application/json")

    async def handle_admin_drain(self, request: web.Request) -> web.Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        model = await self._model_from(request)
        self.core.drain(model)
        return web.json_response({"model": model, "draining": True})

    async def handle_admin_undrain(self, request: web.Request) -> web.Response:
        if (denied := self._admin_denied(request)) is not None:
            return denied
        model = await self._model_from(request)
        self._apply(self.core.undrain(model, self.clock()))
        return web.json_response({"model": model, "draining": False})

    async def handle_admin_reload(self, request: web.Request) -> web.Response:
        """Apply a new config (YAML or JSON in the body, else the file the gateway started from)
        without dropping queued or in-flight requests."""
        if (denied := self._admin_denied(request)) is not None:
            return denied
        raw = await request.read()
        try:
            if raw.strip():
                data = yaml.safe_load(raw)
                if not isinstance(data, dict):
                    raise ConfigError("reload body: the top level must be a mapping")
                config = parse_config(data, "reload body")
            elif self.config_path:
                config = load_config(self.config_path)
            else:
                raise ConfigError("send the new config in the body (no config file to re-read)")
        except (ConfigError, ValueError, yaml.YAMLError) as exc:
            return web.json_response({"error": {"message": str(exc), "type": "invalid_request_error"}}, status=400)
        self._apply_config(config)
        self._apply(self.core.reload(config, self.clock()))
        self._sync_scrapers()
        return web.json_response({"reloaded": True, "models": list(self._models),
                                  "tenants": [t.name for t in config.tenants]})


async def _sse_batches(chunks: AsyncIterator[bytes]) -> AsyncIterator[list[bytes]]:
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


def _event_json(event: bytes) -> Any:
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


def _has_content(obj: dict[str, Any]) -> bool:
    for choice in obj.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def serve_gateway(gateway: Gateway, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    """Run until cancelled. Handler cancellation is on so a client that disconnects while
    queued leaves the queue at once, and one that disconnects mid-stream cancels upstream."""
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=1024).start()
    if ready is not None:
        ready.set()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
