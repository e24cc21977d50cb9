"""The control plane: one per process, whichever front asks it (`bouncer.gateway.fronts`).

It holds the admission core and what keeps the core's view true: the scrapers, the KV-event
subscribers, outside pressure signals, the shared state of several gateways, the flight
recorder, config reloads, the ticker that runs the core's deadlines, and the operator endpoints
(`/metrics`, `/admin/*`, `/ui`, `/health`, `/ready`) on its HTTP port.

A front opens an exchange per request (`open_exchange`: its id, arrival, access line and span),
hands it the parsed request (`admit`), then what it sees of the answer (`started`, `finish`) or
the client leaving (cancelling `admit`'s wait, or `finish` with CANCELLED), and closes it
(`close_exchange`, which writes the access line once); each front says what it cannot see.
What follows each of the core's decisions (diverts, claims, the quota's settling, lease renewal)
is the journey's (`bouncer.core.journey`), which the simulator runs too: this plane does its
waiting. Every admitted request is finished on every path: the
front that got its `Dispatch` owns its permit in one `try/finally`, and the journey renews its
lease while it is served. A permit that still got lost (a bug) is taken back by the core when its
lease runs out, counted in `bouncer_permits_reclaimed_total` and logged. Nothing policy-shaped
lives here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import itertools
import logging
import os
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from bouncer.config import Backend, BouncerConfig
from bouncer.core.admission import AdmissionCore
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.intake import checks
from bouncer.core.intake.retries import retry_key
from bouncer.core.journey import Claim, Go, Journey, Outcome, Refuse, Relay, Step
from bouncer.core.model_state import backend_name
from bouncer.core.outcomes import Dispatch, Divert, Event, Layer, Reason, Reclaimed, Refusal, Reject, Terminal
from bouncer.core.sharing.first_attempts import SharedRetries
from bouncer.core.sharing.shared_rate_limits import SharedRateLimits
from bouncer.core.stores import Stores
from bouncer.gateway import kv_event_feed, logs, pressure_feeds
from bouncer.gateway.admin import Admin
from bouncer.gateway.connections import GuardedSite, Limits
from bouncer.gateway.discovery import Finders
from bouncer.gateway.errors import error_response, plain_error
from bouncer.gateway.metrics import GatewayMetrics
from bouncer.gateway.parsed_request import Exchange, Parsed
from bouncer.gateway.prepared import Front, Prepared, check_front, prepare
from bouncer.gateway.quota_keeper import QuotaKeeper
from bouncer.gateway.ratelimit_headers import ratelimit_headers
from bouncer.gateway.recording import GatewayRecorder
from bouncer.gateway.request_parsing import (
    fairness_id_from_headers,
    key_digest_from_headers,
    request_head,
    with_prompt,
)
from bouncer.gateway.scrapers import PARSERS
from bouncer.gateway.shared_state import SharedState
from bouncer.openai_wire import ApiError, dumps, models_list, parse_json_object
from bouncer.quotas.settings import OverflowTarget
from bouncer.recorder.page import add_page_routes

log = logging.getLogger("bouncer.gateway")

TICK_MIN_S = 0.005
TICK_MAX_S = 0.1  # the core's TTL deadlines are checked at least this often
# Bodies larger than this are tokenized off the event loop. The tokenizer lets go of the GIL, so
# in a thread a prompt of a few thousand tokens no longer holds up every other request queued on
# the loop (docs/benchmarks/long-prompts-and-floods.md has what it bought in the rogue drill).
TOKENIZE_IN_THREAD_BYTES = 4 * 1024
SCRAPE_TIMEOUT_S = 5.0  # a scrape that has not answered in this long failed
LOOP_LAG_PROBE_S = 0.1
SHOWN_MODEL_CHARS = 64  # of a model name no config names, what the access line and the span show


class ControlPlane:
    def __init__(self, config: BouncerConfig, *, config_path: str | None = None, front: Front = "proxy",
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`front`: the front it serves, the HTTP proxy or the endpoint picker (`bouncer.gateway.fronts`)."""
        self.clock = clock
        self.config_path = config_path
        self.front = front
        prepared = prepare(config)  # raises ConfigError before anything starts
        check_front(config, front)
        # behind the picker an answer goes by unseen past its first token (but for the few read
        # whole): decode speed is learned from the engines' own inter-token latency
        decodes_from_engines = front == "picker"
        self.shared: SharedState | None = None  # several gateways: what they share, in Redis
        if config.shared_state is not None:
            shared_limits = SharedRateLimits()
            r = config.policy.retries
            shared_retries = SharedRetries(r.remember_s, r.max_remembered)
            self.core = AdmissionCore(config, clock(), dataclasses.replace(Stores.local(), rate_limits=shared_limits,
                                                                           retries=shared_retries),
                                      decodes_from_engines=decodes_from_engines)
            self.shared = SharedState(config.shared_state, shared_limits, clock,
                                      own_part=lambda: self.core.own_share(self.clock()),
                                      seen=lambda others: self.apply(self.core.peers(others, self.clock())),
                                      retries=shared_retries)
        else:
            self.core = AdmissionCore(config, clock(), decodes_from_engines=decodes_from_engines)
        self.quotas = QuotaKeeper(config) if config.quotas is not None else None  # spend over days and months
        # what follows each decision, as the simulator runs it too (`bouncer.core.journey`)
        self.journey = Journey(self.core, self.quotas, claims=self.shared is not None)
        self._install(prepared)
        self.connections = Limits(config.listen.header_timeout_s, config.listen.max_connections)
        self.metrics = GatewayMetrics(lambda: self.core, clock, lambda: self.kv_event_stats, lambda: self.connections,
                                      lambda: self.shared, lambda: self.finders.by_model, lambda: self.quotas)
        self.tracer = None  # OpenTelemetry (`tracing:`): its SDK is imported only where it is configured
        if config.tracing is not None:
            from bouncer.gateway.tracing import Tracer

            self.tracer = Tracer(config.tracing, clock)
        self.recorder = GatewayRecorder(config.recorder, lambda: self.core.view, clock, self._recorded_gauges)
        self.loop_lag_s = 0.0  # the last probe's (`_probe_loop_lag`)
        self.stopping = False  # SIGTERM came: not ready, finishing what it holds (`drain_for_exit`)
        # a random part per process: ids stay unique across the gateways (or pickers) of one
        # fleet and across restarts, so their logs, traces and recordings can be read together
        self._id_prefix = f"bq-{secrets.token_hex(3)}-"
        self._ids = itertools.count()
        self._waiters: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()  # work past a request's end (`background`)
        self._scrapers: dict[str, asyncio.Task] = {}
        self._pressure_polls: list[asyncio.Task] = []  # one per outside signal (`pressure:`)
        self.finders = Finders(self._found, clock)  # the replicas of models with `discovery:`
        # KV-event subscriptions: replica -> ((endpoint, topic), task), and their counters
        self._kv_subs: dict[str, tuple[tuple[str, str], asyncio.Task]] = {}
        self.kv_event_stats: dict[str, kv_event_feed.SubscriberStats] = {}
        self._zmq: kv_event_feed.zmq.asyncio.Context | None = None
        self.session: aiohttp.ClientSession | None = None  # scrapes

    def _install(self, prepared: Prepared) -> None:
        self.prepared = prepared
        self.config = prepared.config

    # -- lifecycle ---------------------------------------------------------------------------------
    def http_app(self) -> web.Application:
        """The HTTP port's app: the operator endpoints, and the control loops' start and stop
        with it; a front adds its own routes."""
        app = web.Application(client_max_size=self.config.limits.max_body_bytes + 1, middlewares=[self.guard])
        self._add_routes(app)
        return app

    # -- the HTTP port --------------------------------------------------------------------------------
    @web.middleware
    async def guard(self, request: web.Request, handler) -> web.StreamResponse:
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

    def _add_routes(self, app: web.Application) -> None:
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/ready", self.handle_ready)
        Admin(self).add_routes(app)
        add_page_routes(app)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)

    async def _start(self, _app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, json_serialize=lambda o: dumps(o).decode(),
                                             timeout=aiohttp.ClientTimeout(total=None))
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._ticker()))
        self._tasks.append(loop.create_task(self._renew_leases()))
        self._tasks.append(loop.create_task(self.recorder.run()))
        self._tasks.append(loop.create_task(self._probe_loop_lag()))
        if self.quotas is not None:
            self._tasks.append(loop.create_task(self.quotas.run()))
        await self.finders.start(self.config)
        self._sync_scrapers()
        self._sync_pressure()
        if self.shared is not None:
            await self.shared.start()  # degraded (as configured) until Redis answers

    async def _stop(self, _app: web.Application) -> None:
        subs = [task for _, task in self._kv_subs.values()]
        tasks = [*self._tasks, *self._background, *self._scrapers.values(), *subs, *self._pressure_polls]
        for task in tasks:
            task.cancel()  # a request's work in the background settles what it knows as it stops
        await asyncio.gather(*tasks, self.finders.stop(), return_exceptions=True)
        if self._zmq is not None:
            self._zmq.destroy(linger=0)  # closes any subscriber socket left, then terminates
        if self.session is not None:
            await self.session.close()
        if self.shared is not None:
            await self.shared.close()
        if self.quotas is not None:
            await self.quotas.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.close)  # what is still batched goes out first

    def _sync_pressure(self) -> None:
        """One poll per outside signal of the config in force (all restarted on a reload)."""
        for task in self._pressure_polls:
            task.cancel()
        loop = asyncio.get_running_loop()
        self._pressure_polls = [loop.create_task(pressure_feeds.poll(cfg, self.session, self.core.observe_pressure,
                                                                     self.clock)) for cfg in self.config.pressure]

    def _found(self, model: str, backends: list[Backend]) -> None:
        """A finder's new set of replicas: in the config in force and in the core, then scraped."""
        m = self.prepared.models[model].with_backends(backends)
        config = self.config.with_model(m)
        self._install(dataclasses.replace(self.prepared, config=config, models={**self.prepared.models, model: m}))
        self.apply(self.core.set_backends(m, self.clock()))
        self._sync_scrapers()

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
        for name in [n for n in self.kv_event_stats if n not in wanted]:
            del self.kv_event_stats[name]  # a replica gone for good (discovery): its counters go too
        for name, where in wanted.items():
            if name in live and name not in self._kv_subs:
                if self._zmq is None:
                    self._zmq = kv_event_feed.zmq.asyncio.Context()
                stats = self.kv_event_stats.setdefault(name, kv_event_feed.SubscriberStats())

                def deliver(events, name=name):
                    self.core.kv_events(name, events, self.clock())
                task = asyncio.get_running_loop().create_task(
                    kv_event_feed.subscribe(where[0], where[1], deliver, stats, self._zmq))
                self._kv_subs[name] = (where, task)

    # -- core events -------------------------------------------------------------------------------
    def apply(self, events: list[Event]) -> None:
        """Act on the core's decisions, through the journey around them."""
        self.deliver(self.journey.steps(events, self.clock()))

    def deliver(self, steps: list[Step]) -> None:
        """Each waiting request hears its own step."""
        if self.shared is not None:
            self.shared.settle()  # charges the core did not take, or gave back
        for step in steps:
            if isinstance(step, Reclaimed):
                log.warning("permit reclaimed: its lease ran out unrenewed", extra={
                    "event": "permit_reclaimed", "rid": step.request_id, "tenant": step.tenant, "band": step.band,
                    "replica": step.replica, "age_s": round(step.age_s, 3)})
                continue
            rid = step[0].request_id
            fut = self._waiters.pop(rid, None)
            if fut is not None and not fut.done():
                fut.set_result(step)
            elif isinstance(step, Go | Claim):  # its client is gone already: the permit goes straight back
                self.deliver(self.journey.finished(rid, self.clock(), Outcome(Terminal.CANCELLED,
                                                                             Reason.CLIENT_DISCONNECTED)))
            elif isinstance(step, Relay):
                self.journey.relayed(rid, Outcome(Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED))

    # -- what a front hands over ------------------------------------------------------------------
    def request_id(self) -> str:
        """Unique and not guessable: an id names a request wherever it goes (logs, traces, the
        engine, Envoy's access log), and one that could be guessed could be ended by another."""
        return f"{self._id_prefix}{next(self._ids)}-{os.urandom(4).hex()}"

    def open_exchange(self, path: str, front: str | None = None, headers=None, kind: str | None = None) -> Exchange:
        """A request arrived at a front: its exchange, with a fresh id, its access line begun and,
        where tracing is on and the front traces (`headers` and `kind` given), its span."""
        rid = self.request_id()
        line: dict[str, Any] = {"rid": rid, "path": path, "tenant": "-", "outcome": Terminal.CANCELLED.value}
        if front is not None:
            line["front"] = front
        at = self.clock()
        span = self.tracer.begin(headers, kind, path, at) if self.tracer is not None and kind is not None else None
        return Exchange(rid, at, line, span)

    def close_exchange(self, ex: Exchange, status: int | None) -> None:
        """The request is over for its front: its access line is written (once) with the status
        its client got, and its span ended."""
        if ex.closed:
            return
        ex.closed = True
        ex.line["status"] = status
        now = self.clock()
        if self.config.logging.access_log:
            ex.line["duration_s"] = round(now - ex.began, 4)
            logs.access(ex.line)
        if ex.span is not None:
            self.tracer.end(ex.span, ex.line, ex.began, now)  # type: ignore[union-attr]

    def unauthenticated(self, ex: Exchange, headers) -> Refusal | None:
        """The refusal of a request whose headers name no tenant (and that no default tenant
        takes), before its body is read or parsed: a caller without a key costs the gateway
        no more than its headers."""
        if self.core.view.tenant_of(key_digest_from_headers(headers), fairness_id_from_headers(headers)) is not None:
            return None
        return self.refuse_early(ex, Refusal(Layer.VALIDATION, Reason.UNAUTHENTICATED, "invalid or missing API key"))

    def parse(self, ex: Exchange, kind: str, raw: bytes, headers) -> Parsed | Refusal:
        """A generation request's body (already within `limits.max_body_bytes`) and headers,
        checked whole but not tokenized; or the refusal its client gets (recorded here)."""
        prepared = self.prepared  # one config for the whole request, even if a reload lands meanwhile
        try:
            body = parse_json_object(raw)
            model = prepared.models.get(body.get("model")) if isinstance(body.get("model"), str) else None
            tokenizer = prepared.tokenizers.get(model.name) if model else None
            head = request_head(ex.rid, kind, body, headers, tokenizer, model.media_tokens if model else 0)
        except ApiError as err:
            reason = Reason.INVALID_REQUEST if err.code == "invalid_json" else Reason.INVALID_PARAMETER
            return self.refuse_early(ex, Refusal(Layer.VALIDATION, reason, err.message, param=err.param))
        # a model no config names is the client's text, of any length: its access line (and its
        # span's name) shows the start of it
        shown = head.model if model is not None or len(head.model) <= SHOWN_MODEL_CHARS else \
            head.model[:SHOWN_MODEL_CHARS] + "..."
        ex.line.update(model=shown, stream=bool(body.get("stream")))
        if head.session_id:  # an agent's step: its decisions can be followed session by session
            ex.line.update(session=head.session_id, parent_session=head.parent_session_id)
        return Parsed(kind, body, head, raw, model, tokenizer)

    def models_answer(self, headers) -> tuple[int, bytes]:
        """`GET /v1/models`, as both fronts answer it: (status, JSON body)."""
        names = self.visible_models(headers)
        if names is None:
            return 401, dumps(ApiError(401, "invalid or missing API key", "authentication_error",
                                       code="unauthenticated").body())
        return 200, dumps(models_list(names))

    def visible_models(self, headers) -> list[str] | None:
        """The models `GET /v1/models` lists for a request with these headers; None: it needs a
        tenant's key (`access.models_need_key`) and has none."""
        names = list(self.prepared.models)
        if not self.config.access.models_need_key:
            return names
        digest = key_digest_from_headers(headers)
        tenant = self.config.tenant_by_key().get(digest) if digest else None
        if tenant is None:
            return None
        return [n for n in names if not tenant.models or n in tenant.models]

    def ratelimit_headers(self, tenant: str) -> dict[str, str]:
        """The `x-ratelimit-*` headers for an answer to `tenant` (none where it has no rate limit)."""
        return ratelimit_headers(*self.core.view.rate_headroom(tenant, self.clock()))

    def refuse_early(self, ex: Exchange, refusal: Refusal) -> Refusal:
        """A refusal made before the core saw the request (body, JSON, parameters)."""
        self.core.record_refusal(ex.rid, refusal)
        ex.line.update(outcome=Terminal.REFUSED.value, layer=refusal.layer.value, reason=str(refusal.reason))
        return refusal

    @staticmethod
    def refused(step: Refuse, line: dict[str, Any]) -> Refusal:
        r, decision = step.reject.refusal, step.reject
        if step.via is not None:  # refused by the pool it was diverted to
            line["overflow"] = step.via.target
        line.update(tenant=decision.tenant, band=decision.band, outcome=decision.terminal.value, layer=r.layer.value,
                    reason=str(r.reason))
        return r

    async def admit(self, ex: Exchange, parsed: Parsed) -> Dispatch | Divert | Refusal:
        """The core's decision for a parsed request: its dispatch (the front serves it and owns
        its permit from here), its divert to an external overflow endpoint (the front relays it
        and calls `finish_diverted`), or the refusal its client gets. A front cancelled while this
        waits (its client left) takes the request out of the queue."""
        head = parsed.head
        # the layers that need no prompt first: what they refuse (a flood over its rate limit, a
        # full tenant queue, sheddable traffic while saturated) is never tokenized
        checked = self.core.precheck(head, self.clock())
        if isinstance(checked, Reject):
            return self.refused(Refuse(checked), ex.line)
        block_size = parsed.model.block_size if parsed.model else 16
        media_tokens = parsed.model.media_tokens if parsed.model else 0
        args = (head, parsed.kind, parsed.body, parsed.tokenizer, block_size, media_tokens)
        info = await asyncio.to_thread(with_prompt, *args) if len(parsed.raw) > TOKENIZE_IN_THREAD_BYTES \
            else with_prompt(*args)
        ex.line.update(prompt_tokens=info.prompt_tokens)
        if self.shared is not None and info.retry_count and (key := retry_key(checked.name, info)) is not None:
            await self.shared.first_attempt(key)  # a retry: when its first attempt came, at any gateway
        if self.shared is not None and (charge := checks.rate_charge(
                info, checked, parsed.model, self.config.limits)) is not None:
            await self.shared.charge(checked.name, charge)  # the rate verdict, from the gateways' Redis
        rid = head.request_id
        if self.quotas is not None and self.quotas.applies(checked.name):
            # its expected cost reserved, or its tenant found over (`quota_keeper`); settled by the journey
            info.over_quota = await self.quotas.reserve(rid, checked.name, info.model, info.prompt_tokens,
                                                        self.core.view.predicted_output(checked.name, info))
        return await self._served(ex, lambda: self.journey.offer(info, self.clock(), checked))

    async def requeue(self, ex: Exchange, retry_after: float | None) -> Dispatch | Refusal:
        """The replica refused the dispatched request before its client saw anything: the core
        holds it again until it fits elsewhere, or ends it (its quota's reservation given back)."""
        result = await self._served(ex, lambda: self.journey.requeue(ex.rid, self.clock(), retry_after))
        assert not isinstance(result, Divert)  # a request diverts only when it is first offered
        return result

    async def _served(self, ex: Exchange, call: Callable[[], list[Step]]) -> Dispatch | Divert | Refusal:
        """Follow the journey's steps for the request until it is to be served, relayed or refused."""
        rid, line = ex.rid, ex.line
        try:
            step = await self.decision(rid, call)
            while isinstance(step, Claim):
                d = step.dispatch
                others = await self._claim(d)
                step = await self.decision(rid, lambda d=d, o=others: self.journey.claimed(d, o, self.clock()))
        except BaseException:
            self.journey.forget(rid)
            raise
        if isinstance(step, Refuse):
            return self.refused(step, line)
        if isinstance(step, Relay):
            line.update(outcome=Terminal.DIVERTED.value, reason=str(step.divert.refusal.reason),
                        overflow=step.target.name)
            return step.divert
        d = step.dispatch
        if step.via is not None:
            line.update(outcome=Terminal.DIVERTED.value, reason=step.via.reason, overflow=step.via.target)
        line.update(tenant=d.tenant, band=d.band)
        wait = d.dispatched_at - d.arrival
        self.metrics.observe_queue_wait(d.tenant, d.band, wait)
        line.update(queue_wait_s=round(wait, 4), replica=d.replica)
        return d

    def overflow_target(self, model: str, name: str) -> OverflowTarget:
        return next(t for t in self.prepared.models[model].overflow if t.name == name)

    def replica_url(self, name: str) -> str:
        return self.core.view.replica(name).url

    def replicas_of(self, model: str) -> list[tuple[str, str]]:
        """The live replicas serving `model`: (name, URL)."""
        view = self.core.view
        return [(name, r.url) for name in view.replica_names(live_only=True)
                if (r := view.replica(name)).model == model]

    def started(self, rid: str, at: float, measured: bool = True) -> None:
        """Its first token reached the front (`measured`: at the time the front saw it)."""
        self.journey.started(rid, at, measured)

    def handed_over(self, rid: str) -> None:
        """Its prefill worker is done: its KV goes to its decode worker."""
        self.deliver(self.journey.handed_over(rid, self.clock()))

    def finish(self, ex: Exchange, d: Dispatch, out: Outcome, streamed: bool) -> None:
        """An admitted request is over, as its front saw it end: its permit goes back, its quota
        is settled, and what was seen of it is learnt and counted. `out.completion_tokens` None:
        the front did not see the answer's length, and nothing is learnt from it."""
        now, line = self.clock(), ex.line
        if out.terminal is Terminal.COMPLETED:
            tokens = out.completion_tokens or 0
            tpot = (now - out.first_token_at) / (tokens - 1) \
                if out.first_token_at is not None and tokens > 1 and streamed else None
            self.metrics.observe_completed(d.tenant, d.arrival, out.first_token_at, tpot, now)
        if "overflow" in line:  # diverted to another pool: the access line keeps `diverted`
            line["overflow_outcome"] = out.terminal.value
        else:
            line.update(outcome=out.terminal.value, reason=out.reason)
        self._note_usage(out, line)
        line.update(ttft_s=None if out.first_token_at is None else round(out.first_token_at - d.arrival, 4),
                    layer=Layer.UPSTREAM.value if out.terminal is Terminal.FAILED else None)
        self.deliver(self.journey.finished(d.request_id, now, out))

    def finish_diverted(self, ex: Exchange, d: Divert, model: str, out: Outcome) -> None:
        """A request diverted to an external endpoint is over (the core counted it when it
        diverted it): its quota is settled at the target's price, and how it ended is counted."""
        self.metrics.overflow.labels(model, d.target, out.terminal.value).inc()
        self._note_usage(out, ex.line)
        ex.line["overflow_outcome"] = out.terminal.value
        self.journey.relayed(d.request_id, out)

    @staticmethod
    def _note_usage(out: Outcome, line: dict[str, Any]) -> None:
        """The access line's usage: the completion tokens, and the engine's prompt count where it
        gave one (the gateway's own count kept beside it where they differ)."""
        line["completion_tokens"] = out.completion_tokens
        counted = line.get("prompt_tokens")
        if out.prompt_tokens is not None and out.prompt_tokens != counted:
            line.update(prompt_tokens=out.prompt_tokens, prompt_tokens_counted=counted)

    def background(self, work: Awaitable[None]) -> None:
        """Run `work` past the request that started it (kept until done; stopped with the plane)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _claim(self, d: Dispatch) -> int | None:
        """Claim the nearly full replica `d` goes to (`bouncer.core.sharing.claims`); the permit is this
        request's meanwhile, so a client that leaves gives it back."""
        assert self.shared is not None and d.claim is not None
        try:
            return await self.shared.claim(d.replica, d.claim)
        except asyncio.CancelledError:
            self.deliver(self.journey.finished(d.request_id, self.clock(), Outcome(Terminal.CANCELLED,
                                                                                 Reason.CLIENT_DISCONNECTED)))
            raise

    async def decision(self, rid: str, call: Callable[[], list[Step]]) -> Step:
        """Take the journey's steps and wait for this request's; a client that goes away while
        its request is queued takes it out of the queue."""
        fut = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        self.deliver(call())
        try:
            return await fut
        except asyncio.CancelledError:
            self._waiters.pop(rid, None)
            now = self.clock()
            if fut.done() and not fut.cancelled() and isinstance(fut.result(), Go | Claim):
                # dispatched in the very turn the client left (the result was set, the task was
                # cancelled before it ran on): its permit goes straight back
                self.deliver(self.journey.finished(rid, now, Outcome(Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED)))
            else:
                self.deliver(self.journey.cancel(rid, now))
            raise

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
            await asyncio.sleep(max(TICK_MIN_S, self.journey.next_renewal - self.clock()))
            self.journey.renew(self.clock())

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

    async def handle_health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def readiness(self) -> dict[str, bool]:
        """Each model: whether a replica of it answers (ready when all do); none while stopping."""
        snap = self.core.snapshot(self.clock())
        return {name: not self.stopping and any(r["answering"] and not r["removed"] for r in m["replicas"].values())
                for name, m in snap["models"].items()}

    async def handle_ready(self, _request: web.Request) -> web.Response:
        ready = self.readiness()
        status = 200 if all(ready.values()) else 503
        return web.json_response({"ready": status == 200, "stopping": self.stopping, "models": ready},
                                 status=status)

    async def drain_for_exit(self, grace_s: float) -> None:
        """SIGTERM: readiness goes to 503 (Kubernetes takes the pod out of its Service) while
        requests still arriving are served as usual and those queued and in flight finish, for
        up to `grace_s`; what is left then is cut when the front stops."""
        self.stopping = True
        deadline = self.clock() + grace_s
        log.info("stopping: finishing the requests held", extra={
            "event": "stopping", "serving": self.serving, "queued": self.core.view.queued, "drain_s": grace_s})
        while (self.serving or self.core.view.queued) and self.clock() < deadline:
            await asyncio.sleep(0.1)
        log.info("stopped" if not (self.serving or self.core.view.queued) else "stopped: drain_s ran out", extra={
            "event": "stopped", "serving": self.serving, "queued": self.core.view.queued})

    def _recorded_gauges(self) -> dict:
        """What only the shell knows, for the flight recorder's samples."""
        return {"serving": self.serving, "connections_open": self.connections.open,
                "loop_lag_s": round(self.loop_lag_s, 4)}

    @property
    def serving(self) -> int:
        """Admitted requests being served now."""
        return len(self.journey.live)

    def reconfigure(self, prepared: Prepared) -> None:
        """Swap in a new config, validated and prepared (`admin.py`'s reload): the core's
        policies and tenants, scrapers for its replicas, its outside signals."""
        old = self.config
        config = self.finders.held(prepared.config)  # the replicas found so far, kept
        prepared = dataclasses.replace(prepared, config=config, models={m.name: m for m in config.models})
        self.apply(self.core.reload(config, self.clock()))
        self._install(prepared)
        if self.quotas is not None:
            self.quotas.reconfigure(config)
        self.recorder.reconfigure(config.recorder)
        self._sync_scrapers()
        if config.pressure != old.pressure:
            self._sync_pressure()
        self.finders.follow(config)


async def until_terminated(plane: ControlPlane, serving: Awaitable[None]) -> None:
    """Run a front (`serving`) until SIGTERM or SIGINT, then drain (`ControlPlane.drain_for_exit`,
    `listen.drain_s`) and stop it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    front = loop.create_task(serving)
    stopped = loop.create_task(stop.wait())
    try:
        await asyncio.wait({front, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if front.done():
            front.result()  # an error starting it (the address taken) is raised here
            return
        await plane.drain_for_exit(plane.config.listen.drain_s)
    finally:
        for task in (front, stopped):
            task.cancel()
        await asyncio.gather(front, stopped, return_exceptions=True)


async def serve_http(plane: ControlPlane, app: web.Application, host: str, port: int,
                     ready: asyncio.Event | None = None, on_listening: Callable[[], None] | None = None) -> None:
    """Run `app` (`plane.http_app()` with a front's routes) until cancelled. Handler cancellation is on so
    a client that disconnects while queued leaves the queue at once, and one that disconnects
    mid-stream cancels upstream. `on_listening` runs once the socket is bound (an error binding
    it raises instead)."""
    listen = plane.config.listen
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = GuardedSite(runner, host, port, plane.connections,
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
