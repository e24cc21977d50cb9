"""The asyncio gateway: an OpenAI-compatible HTTP shell around the admission core.

Per request: read the body (within `listen.body_timeout_s`), parse and check it, tokenize, offer
it to the core, wait for its decision (queued requests wait here and leave the queue if the
client disconnects), then relay the chosen replica's answer (`relay.py`) and report the outcome
back. Nothing policy-shaped lives here.

Admission happens before the first byte: a streaming response starts (200 and the event stream)
only once the upstream has produced its first event, so a refusal, including vLLM's refusal sent
as HTTP 200 with an error event, is always a clean HTTP error with Retry-After.

Every admitted request is finished in the core on every path by construction: from the moment
its `Dispatch` arrives, one `try/finally` (`_serve_admitted`) owns its permit, and while it runs
the permit's lease is renewed (`_renew_leases`). A permit that still got lost (a bug) is taken
back by the core when its lease runs out, counted in `bouncer_permits_reclaimed_total` and logged.
Every answer is an OpenAI error body or the backend's relayed success; a bug answers 500
`internal_error`, logged with its traceback and counted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import yarl
from aiohttp import web

from bouncer.config import BouncerConfig
from bouncer.core.admission import AdmissionCore
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.intake import checks
from bouncer.core.intake.retries import retry_key
from bouncer.core.model_state import backend_name
from bouncer.core.outcomes import Dispatch, Event, Layer, Reason, Reclaimed, Refusal, Reject, Terminal
from bouncer.core.sharing.rate_limits import SharedRateLimits
from bouncer.core.sharing.retries import SharedRetries
from bouncer.core.stores import Stores
from bouncer.gateway import kv_events, logs, pressure_feeds
from bouncer.gateway.admin import Admin
from bouncer.gateway.connections import GuardedSite, Limits
from bouncer.gateway.disaggregated import kv_transfer_params, prefill_body
from bouncer.gateway.errors import error_response, plain_error
from bouncer.gateway.metrics import GatewayMetrics
from bouncer.gateway.prepared import Prepared, prepare
from bouncer.gateway.recording import GatewayRecorder
from bouncer.gateway.relay import Outcome, Requeue, UpstreamFailure, failure_for_status, relay_json, relay_stream
from bouncer.gateway.request_parsing import key_digest_from_headers, request_head, with_prompt
from bouncer.gateway.scrapers import PARSERS
from bouncer.gateway.shared_state import SharedState
from bouncer.gateway.upstream import UpstreamError, UpstreamPool, UpstreamTimeout
from bouncer.openai_wire import ApiError, dumps, models_list, parse_json_object
from bouncer.recorder.page import add_page_routes

log = logging.getLogger("bouncer.gateway")

TICK_MIN_S = 0.005
TICK_MAX_S = 0.1  # the core's TTL deadlines are checked at least this often
UPSTREAM_CONNECT_TIMEOUT_S = 5.0
UPSTREAM_READ_TIMEOUT_S = 300.0  # silence on an upstream stream this long is a timeout
# Bodies larger than this are tokenized off the event loop. The tokenizer lets go of the GIL, so
# in a thread a prompt of a few thousand tokens (1-3 ms) no longer holds up every other request
# queued on the loop: in the rogue drill (300 clients on ~3,000-token prompts) the interactive
# tenant's TTFT p99 went from 1.0-2.4 s (at 32 KB) to 0.36-0.40 s, for 50-400 us more gateway CPU
# per refusal (bench flood, three alternating runs each).
TOKENIZE_IN_THREAD_BYTES = 4 * 1024
SCRAPE_TIMEOUT_S = 5.0  # a scrape that has not answered in this long failed
LOOP_LAG_PROBE_S = 0.1


class Gateway:
    def __init__(self, config: BouncerConfig, *, config_path: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.config_path = config_path
        prepared = prepare(config)  # raises ConfigError before anything starts
        self.shared: SharedState | None = None  # several gateways: what they share, in Redis
        if config.shared_state is not None:
            shared_limits = SharedRateLimits()
            r = config.policy.retries
            shared_retries = SharedRetries(r.remember_s, r.max_remembered)
            self.core = AdmissionCore(config, clock(), dataclasses.replace(Stores.local(), rate_limits=shared_limits,
                                                                           retries=shared_retries))
            self.shared = SharedState(config.shared_state, shared_limits, clock,
                                      own_part=lambda: self.core.own_share(self.clock()),
                                      seen=lambda others: self.apply(self.core.peers(others, self.clock())),
                                      retries=shared_retries)
        else:
            self.core = AdmissionCore(config, clock())
        self._install(prepared)
        self.connections = Limits(config.listen.header_timeout_s, config.listen.max_connections)
        self.metrics = GatewayMetrics(lambda: self.core, clock, lambda: self.kv_event_stats, lambda: self.connections,
                                      lambda: self.shared)
        self.recorder = GatewayRecorder(config.recorder, lambda: self.core.view, clock, self._recorded_gauges)
        self.loop_lag_s = 0.0  # the last probe's (`_probe_loop_lag`)
        self._ids = itertools.count()
        self._waiters: dict[str, asyncio.Future] = {}
        self._live: set[str] = set()  # admitted requests being served: their permits' leases are renewed
        self._tasks: list[asyncio.Task] = []
        self._scrapers: dict[str, asyncio.Task] = {}
        self._pressure_polls: list[asyncio.Task] = []  # one per outside signal (`pressure:`)
        # KV-event subscriptions: replica -> ((endpoint, topic), task), and their counters
        self._kv_subs: dict[str, tuple[tuple[str, str], asyncio.Task]] = {}
        self.kv_event_stats: dict[str, kv_events.SubscriberStats] = {}
        self._zmq: kv_events.zmq.asyncio.Context | None = None
        self.session: aiohttp.ClientSession | None = None  # scrapes
        self.upstream = UpstreamPool(UPSTREAM_CONNECT_TIMEOUT_S, UPSTREAM_READ_TIMEOUT_S)  # proxied requests
        self._urls: dict[tuple[str, str], yarl.URL] = {}

    def _install(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self.config = prepared.config

    # -- lifecycle ---------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.limits.max_body_bytes + 1, middlewares=[self._guard])
        app.router.add_post("/v1/chat/completions", self.handle_chat)
        app.router.add_post("/v1/completions", self.handle_completions)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", self.handle_ready)
        Admin(self).add_routes(app)
        add_page_routes(app)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, json_serialize=lambda o: dumps(o).decode(),
                                             timeout=aiohttp.ClientTimeout(total=None))
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._ticker()))
        self._tasks.append(loop.create_task(self._renew_leases()))
        self._tasks.append(loop.create_task(self.recorder.run()))
        self._tasks.append(loop.create_task(self._probe_loop_lag()))
        self._sync_scrapers()
        self._sync_pressure()
        if self.shared is not None:
            await self.shared.start()  # degraded (as configured) until Redis answers

    async def _stop(self, _app: web.Application) -> None:
        subs = [task for _, task in self._kv_subs.values()]
        for task in [*self._tasks, *self._scrapers.values(), *subs]:
            task.cancel()
        for task in self._pressure_polls:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._scrapers.values(), *subs, *self._pressure_polls,
                             return_exceptions=True)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)  # closes any subscriber socket left, then terminates
        if self.session is not None:
            await self.session.close()
        self.upstream.close()
        if self.shared is not None:
            await self.shared.close()

    def _sync_pressure(self) -> None:
        """One poll per outside signal of the config in force (all restarted on a reload)."""
        for task in self._pressure_polls:
            task.cancel()
        loop = asyncio.get_running_loop()
        self._pressure_polls = [loop.create_task(pressure_feeds.poll(cfg, self.session, self.core.observe_pressure,
                                                                     self.clock)) for cfg in self.config.pressure]

    def _sync_scrapers(self) -> None:
        loop = asyncio.get_running_loop()
        live = set(self.core.view.replica_names(live_only=True))
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
    def apply(self, events: list[Event]) -> None:
        """Act on the core's decisions: each waiting request hears its own."""
        if self.shared is not None:
            self.shared.settle()  # charges the core did not take, or gave back
        for event in events:
            if isinstance(event, Reclaimed):
                log.warning("permit reclaimed: its lease ran out unrenewed", extra={
                    "event": "permit_reclaimed", "rid": event.request_id, "tenant": event.tenant, "band": event.band,
                    "replica": event.replica, "age_s": round(event.age_s, 3)})
                continue
            rid = event.request_id
            fut = self._waiters.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(event)
            elif isinstance(event, Dispatch):
                # its client is gone already: give the permit straight back
                self.apply(self.core.finished(rid, self.clock(), Terminal.CANCELLED,
                                               reason=Reason.CLIENT_DISCONNECTED))

    async def _ticker(self) -> None:
        while True:
            wake = self.core.next_wakeup()
            delay = TICK_MAX_S if wake is None else min(TICK_MAX_S, max(TICK_MIN_S, wake - self.clock()))
            await asyncio.sleep(delay)
            self.apply(self.core.tick(self.clock()))

    async def _probe_loop_lag(self) -> None:
        """How late a 0.1 s timer fires: the event loop's backlog, which every request waits in
        (a flood that starves admitted streams shows here first)."""
        while True:
            due = self.clock() + LOOP_LAG_PROBE_S
            await asyncio.sleep(LOOP_LAG_PROBE_S)
            self.loop_lag_s = max(0.0, self.clock() - due)
            self.metrics.loop_lag.observe(self.loop_lag_s)

    async def _renew_leases(self) -> None:
        """The admitted requests this gateway is serving keep their permits."""
        while True:
            await asyncio.sleep(self.config.policy.permit_lease_s / 4)
            self.core.renew(self._live, self.clock())

    async def _scrape_loop(self, name: str) -> None:
        healthy: bool | None = None
        drifting = False
        while True:
            replica = self.core.view.replica(name)
            model = self.prepared.models[replica.model]
            interval = self.config.policy.telemetry.scrape_interval_s
            at = self.clock()
            telemetry: Telemetry | None
            error = None
            try:
                telemetry = await self._scrape(replica.url, model.engine, replica.configured_blocks, at,
                                               timeout=max(SCRAPE_TIMEOUT_S, 4 * interval))
                telemetry = dataclasses.replace(telemetry, received=self.clock())  # a slow answer is still one
            except Exception as exc:  # noqa: BLE001 (any failure is a failed scrape; the loop must live on)
                telemetry, error = None, f"{type(exc).__name__}: {exc}"
            self.apply(self.core.observe(name, telemetry, self.clock()))
            if (telemetry is not None) != healthy:
                if healthy is not None or telemetry is None:
                    level = logging.INFO if telemetry is not None else logging.WARNING
                    log.log(level, "backend healthy" if telemetry is not None else "backend unhealthy",
                            extra={"event": "backend_health", "replica": name, "url": replica.url,
                                   "healthy": telemetry is not None, "error": error})
                healthy = telemetry is not None
            replica = self.core.view.replica(name)
            if replica.drift_reported != drifting:
                drifting = replica.drift_reported
                log.warning("in-flight drift: the engine runs fewer requests than the gateway counts there"
                            if drifting else "in-flight drift cleared",
                            extra={"event": "inflight_drift", "replica": name, "unseen": replica.unseen_by_engine})
            await asyncio.sleep(max(0.0, at + interval - self.clock()))

    async def _scrape(self, url: str, engine: str, blocks: int | None, at: float, timeout: float) -> Telemetry:
        t = aiohttp.ClientTimeout(total=timeout)
        if engine == "openai":  # no metrics: a liveness probe, load comes from our own accounting
            async with self.session.get(url + "/v1/models", timeout=t) as resp:
                resp.raise_for_status()
            return Telemetry(at=at, kv_usage=0.0, running=0, waiting=0, counts_requests=False)
        async with self.session.get(url + "/metrics", timeout=t) as resp:
            resp.raise_for_status()
            text = await resp.text()
        return PARSERS[engine](text, at, blocks)

    # -- middleware --------------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Tells the connection a request is being handled (its header deadline is met), and
        turns whatever escapes a handler into an OpenAI error body."""
        proto = request.protocol
        notify = hasattr(proto, "request_started")
        if notify:
            proto.request_started()
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's own: unknown path, wrong method
            if exc.status < 400:
                raise
            return plain_error(exc.status, f"{request.method} {request.path}: {exc.reason}",
                                "invalid_request_error", "not_found" if exc.status == 404 else "invalid_request")
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            self.metrics.internal_errors.inc()
            log.exception("internal error", extra={"event": "internal_error", "path": request.path})
            return error_response(Refusal(Layer.VALIDATION, Reason.INTERNAL_ERROR, "internal error in the gateway"))
        finally:
            if notify:
                proto.request_finished()

    # -- OpenAI endpoints --------------------------------------------------------------------------
    async def handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat", "/v1/chat/completions")

    async def handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion", "/v1/completions")

    def _refuse_early(self, rid: str, refusal: Refusal, line: dict) -> web.Response:
        """A refusal made before the core saw the request (body, JSON, parameters)."""
        self.core.record_refusal(rid, refusal)
        line.update(outcome=Terminal.REFUSED.value, layer=refusal.layer.value, reason=str(refusal.reason))
        return error_response(refusal)

    @staticmethod
    def _refused(decision: Reject, line: dict) -> web.Response:
        r = decision.refusal
        line.update(tenant=decision.tenant, band=decision.band, outcome=decision.terminal.value, layer=r.layer.value,
                    reason=str(r.reason))
        return error_response(r)

    async def _generate(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        rid = f"bq-{next(self._ids)}"
        line: dict[str, Any] = {"rid": rid, "path": path, "tenant": "-", "outcome": Terminal.CANCELLED.value}
        t0 = self.clock()
        resp: web.StreamResponse | None = None
        try:
            resp = await self._generate_for(request, kind, path, rid, line)
            return resp
        finally:
            if self.config.logging.access_log:
                line["status"] = resp.status if resp is not None else None
                line["duration_s"] = round(self.clock() - t0, 4)
                logs.access(line)

    async def _generate_for(self, request: web.Request, kind: str, path: str, rid: str,
                            line: dict[str, Any]) -> web.StreamResponse:
        limits = self.config.limits
        too_large = Refusal(Layer.VALIDATION, Reason.BODY_TOO_LARGE,
                            f"request body exceeds {limits.max_body_bytes} bytes")
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            return self._refuse_early(rid, too_large, line)
        try:
            if request.content.is_eof():  # the whole body came with the headers: nothing to wait for
                raw: bytes | None = await request.read()
            else:
                async with asyncio.timeout(self.config.listen.body_timeout_s):  # no task per request (wait_for)
                    raw = await request.read()
        except web.HTTPRequestEntityTooLarge:  # past the app's client_max_size of limit + 1
            raw = None
        except TimeoutError:
            return self._refuse_early(rid, Refusal(Layer.VALIDATION, Reason.REQUEST_TIMEOUT,
                                                   f"the request body did not arrive within "
                                                   f"{self.config.listen.body_timeout_s:g} s"), line)
        if raw is None or len(raw) > limits.max_body_bytes:
            return self._refuse_early(rid, too_large, line)
        prepared = self.prepared  # one config for the whole request, even if a reload lands meanwhile
        try:
            body = parse_json_object(raw)
            model = prepared.models.get(body.get("model")) if isinstance(body.get("model"), str) else None
            tokenizer = prepared.tokenizers.get(model.name) if model else None
            head = request_head(rid, kind, body, request.headers, tokenizer)
        except ApiError as err:
            reason = Reason.INVALID_REQUEST if err.code == "invalid_json" else Reason.INVALID_PARAMETER
            return self._refuse_early(rid, Refusal(Layer.VALIDATION, reason, err.message, param=err.param), line)
        line.update(model=head.model, stream=bool(body.get("stream")))
        if head.session_id:  # an agent's step: its decisions can be followed session by session
            line.update(session=head.session_id, parent_session=head.parent_session_id)
        # the layers that need no prompt first: what they refuse (a flood over its rate limit, a
        # full tenant queue, sheddable traffic while saturated) is never tokenized
        checked = self.core.precheck(head, self.clock())
        if isinstance(checked, Reject):
            return self._refused(checked, line)
        block_size = model.block_size if model else 16
        if len(raw) > TOKENIZE_IN_THREAD_BYTES:
            info = await asyncio.to_thread(with_prompt, head, kind, body, tokenizer, block_size)
        else:
            info = with_prompt(head, kind, body, tokenizer, block_size)
        line.update(prompt_tokens=info.prompt_tokens)
        if self.shared is not None and info.retry_count and (key := retry_key(checked.name, info)) is not None:
            await self.shared.first_attempt(key)  # a retry: when its first attempt came, at any gateway
        if self.shared is not None and (charge := checks.rate_charge(
                info, checked, model, self.config.limits)) is not None:
            await self.shared.charge(checked.name, charge)  # the rate verdict, from the gateways' Redis
        decision = await self._decision(rid, lambda: self.core.offer(info, self.clock(), checked))
        while True:
            if isinstance(decision, Reject):
                return self._refused(decision, line)
            if decision.claim is not None and self.shared is not None:
                others = await self._claim(decision)
                if others is not None:  # another gateway filled the replica first: held again
                    decision = await self._decision(rid, lambda o=others: self.core.unclaimed(rid, o, self.clock()))
                    continue
            line.update(tenant=decision.tenant, band=decision.band)
            wait = decision.dispatched_at - decision.arrival
            self.metrics.observe_queue_wait(decision.tenant, decision.band, wait)
            line.update(queue_wait_s=round(wait, 4), replica=decision.replica)
            result = await self._serve_admitted(request, path, body, decision, line)
            if not isinstance(result, Requeue):
                return result
            # the replica refused it: the core holds it again until it fits elsewhere, or ends it
            decision = await self._decision(rid, lambda r=result: self.core.requeue(rid, self.clock(), r.retry_after))

    async def _claim(self, d: Dispatch) -> int | None:
        """Claim the nearly full replica `d` goes to (`bouncer.core.sharing.claims`); the permit is this
        request's meanwhile, so a client that leaves gives it back."""
        assert self.shared is not None and d.claim is not None
        try:
            return await self.shared.claim(d.replica, d.claim)
        except asyncio.CancelledError:
            self.apply(self.core.finished(d.request_id, self.clock(), Terminal.CANCELLED,
                                          reason=Reason.CLIENT_DISCONNECTED))
            raise

    async def _decision(self, rid: str, call: Callable[[], list[Event]]) -> Dispatch | Reject:
        """Run a core call and wait for this request's decision; a client that goes away while
        its request is queued takes it out of the queue."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        self.apply(call())
        try:
            return await fut
        except asyncio.CancelledError:
            self._waiters.pop(rid, None)
            now = self.clock()
            if fut.done() and not fut.cancelled() and isinstance(fut.result(), Dispatch):
                # dispatched in the very turn the client left (the result was set, the task was
                # cancelled before it ran on): its permit goes straight back
                self.apply(self.core.finished(rid, now, Terminal.CANCELLED, reason=Reason.CLIENT_DISCONNECTED))
            else:
                self.apply(self.core.cancel(rid, now))
            raise

    async def _serve_admitted(self, request: web.Request, path: str, body: dict[str, Any], d: Dispatch,
                              line: dict[str, Any]) -> web.StreamResponse | Requeue:
        """Send an admitted request upstream and relay the answer. Owns its permit: whatever
        happens here, the core hears how it ended (or gets it back to hold again, on `Requeue`)."""
        rid = d.request_id
        out = Outcome()
        requeued = False
        self._live.add(rid)
        try:
            model = self.prepared.models[d.model]
            url = self.core.view.replica(d.replica).url
            upstream_body = dict(body)
            upstream_body["model"] = model.upstream_model or model.name
            upstream_body["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = d.max_tokens
            streaming = bool(body.get("stream"))
            options = body.get("stream_options") or {}  # checked: an object
            if streaming:
                upstream_body["stream_options"] = {**options, "include_usage": True}

            def first_token(at: float) -> None:
                # a stream's first token is measured; a whole answer only says its prefill is over
                self.core.started(rid, at, measured=streaming)

            read_timeout = self.upstream.read_timeout
            if d.decode_replica is not None:  # disaggregated: the prompt first, on the prefill worker
                url = await self._prefill(rid, url, path, upstream_body, d.decode_replica)
            up = await self.upstream.post_json(self._upstream_url(url, path), dumps(upstream_body))
            try:
                if up.status != 200:
                    raise failure_for_status(up.status, up.headers, await up.read(read_timeout))
                if streaming:
                    return await relay_stream(up, request, read_timeout, bool(options.get("include_usage")),
                                              self.clock, first_token, out)
                return await relay_json(up, request, read_timeout, self.clock, first_token, out)
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
            return error_response(Refusal(Layer.UPSTREAM, out.reason, f"backend connection failed: {exc}", 1.0))
        except (asyncio.CancelledError, ConnectionResetError):
            out.terminal, out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
            raise
        finally:
            self._live.discard(rid)
            if not requeued:
                now = self.clock()
                if out.terminal is Terminal.COMPLETED:
                    tpot = (now - out.first_token_at) / (out.completion_tokens - 1) \
                        if out.first_token_at is not None and out.completion_tokens > 1 and body.get("stream") else None
                    self.metrics.observe_completed(d.tenant, d.arrival, out.first_token_at, tpot, now)
                line.update(outcome=out.terminal.value, reason=out.reason, completion_tokens=out.completion_tokens,
                            ttft_s=None if out.first_token_at is None else round(out.first_token_at - d.arrival, 4),
                            layer=Layer.UPSTREAM.value if out.terminal is Terminal.FAILED else None)
                self.apply(self.core.finished(rid, now, out.terminal, out.completion_tokens, out.reason))

    async def _prefill(self, rid: str, url: str, path: str, upstream_body: dict[str, Any], decode: str) -> str:
        """The P/D hop (`bouncer.gateway.disaggregated`): the prompt on the prefill worker at
        `url`; then the request is the decode worker's, whose URL is returned, and
        `upstream_body` carries where its KV waits."""
        up = await self.upstream.post_json(self._upstream_url(url, path), dumps(prefill_body(upstream_body)))
        try:
            params = await kv_transfer_params(up, self.upstream.read_timeout)
        finally:
            up.close()
        self.apply(self.core.handed_over(rid, self.clock()))
        upstream_body["kv_transfer_params"] = params
        return self.core.view.replica(decode).url

    def _upstream_url(self, base: str, path: str) -> yarl.URL:
        """Parsed once per backend and path: URL parsing is a visible cost per request."""
        url = self._urls.get((base, path))
        if url is None:
            url = self._urls[(base, path)] = yarl.URL(base + path)
        return url

    async def handle_models(self, request: web.Request) -> web.Response:
        names = list(self.prepared.models)
        if self.config.access.models_need_key:
            digest = key_digest_from_headers(request.headers)
            tenant = self.config.tenant_by_key().get(digest) if digest else None
            if tenant is None:
                return plain_error(401, "invalid or missing API key", "authentication_error", "unauthenticated")
            names = [n for n in names if not tenant.models or n in tenant.models]
        return web.Response(body=dumps(models_list(names)), content_type="application/json")

    async def handle_health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def handle_ready(self, _request: web.Request) -> web.Response:
        snap = self.core.snapshot(self.clock())
        ready = {name: any(r["answering"] and not r["removed"] for r in m["replicas"].values())
                 for name, m in snap["models"].items()}
        status = 200 if all(ready.values()) else 503
        return web.json_response({"ready": status == 200, "models": ready}, status=status)

    def _recorded_gauges(self) -> dict:
        """What only the shell knows, for the flight recorder's samples."""
        return {"serving": self.serving, "connections_open": self.connections.open,
                "loop_lag_s": round(self.loop_lag_s, 4)}

    @property
    def serving(self) -> int:
        """Admitted requests being served now."""
        return len(self._live)

    def reconfigure(self, prepared: Prepared) -> None:
        """Swap in a new config, validated and prepared (`admin.py`'s reload): the core's
        policies and tenants, scrapers for its replicas, its outside signals."""
        old = self.config
        config = prepared.config
        self.apply(self.core.reload(config, self.clock()))
        self._install(prepared)
        self.recorder.reconfigure(config.recorder)
        self._sync_scrapers()
        if config.pressure != old.pressure:
            self._sync_pressure()


async def serve_gateway(gateway: Gateway, host: str, port: int, ready: asyncio.Event | None = None,
                        on_listening: Callable[[], None] | None = None) -> None:
    """Run until cancelled. Handler cancellation is on so a client that disconnects while
    queued leaves the queue at once, and one that disconnects mid-stream cancels upstream.
    `on_listening` runs once the socket is bound (an error binding it raises instead)."""
    listen = gateway.config.listen
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = GuardedSite(runner, host, port, gateway.connections,
                           handler_kwargs={"keepalive_timeout": listen.idle_timeout_s, "access_log": None})
        await site.start()
        # what start-up built (config, tokenizers and their vocabularies) leaves the collector's
        # view: the collections that requests' garbage sets off no longer walk it
        gc.freeze()
        if on_listening is not None:
            on_listening()
        if ready is not None:
            ready.set()
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
