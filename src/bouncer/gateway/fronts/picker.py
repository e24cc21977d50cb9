"""The endpoint-picker front: Envoy's external processor (`ext_proc`), as the Gateway API
Inference Extension's endpoint-picker protocol has it. Clients talk to Envoy; Envoy asks this
front where each request goes, and carries the bytes itself.

`bouncer envoy-config` runs two ext_proc filters against this one gRPC service, and the first
message of each stream says which one it is:

- **the picker** (request headers, the request body BUFFERED): the body is checked and offered to
  the control plane. A refusal is answered as an ImmediateResponse (the proxy's status, OpenAI
  error body and headers). A held request is answered late: its body message is answered when the
  core dispatches it, with the chosen replica in `x-gateway-destination-endpoint` (overwriting
  whatever the client sent) and in the `envoy.lb` metadata; a client that leaves meanwhile makes
  Envoy cancel the stream, which cancels the request in the queue. Envoy half-closes the stream
  when the request is over, completed or abandoned alike: that returns the permit.
- **the watcher** (`observability_mode`: Envoy sends and never waits; request headers, the
  response headers and body, STREAMED): the answer's status, and its first chunk, the first
  token. It then closes its stream, so Envoy sends it nothing more, except for at most
  `picker.answers_read_whole` answers at once, read to their end for their usage (the output
  lengths and TPOT the core learns from).

GIE's gateways set ext_proc up in full duplex instead (one filter, every body chunk both ways,
`protocol_config` says so): the picker then answers the request's headers and body once the core
dispatches it, passes each chunk of the answer back unchanged, and reads every answer whole.

So the picker sees every request's first token and end, and answers whole where it reads them;
it cannot tell a client that left mid-stream from a completed answer it did not read whole
(docs/operations/endpoint-picker.md says what each setup sees and costs). The routes Bouncer
serves itself (`/v1/models`, unknown paths) are answered here as the proxy answers them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from multidict import CIMultiDict
from yarl import URL

from bouncer.core.outcomes import Dispatch, Layer, Reason, Refusal, Terminal
from bouncer.gateway import logs
from bouncer.gateway.control_plane import ControlPlane, serve_http
from bouncer.gateway.exchange import Outcome, Parsed
from bouncer.gateway.fronts.ext_proc_wire import (
    header_of,
    headers_of,
    immediate,
    passed_back,
    plain_error,
    refused,
    request_body,
    set_header,
    subset_hint,
    usage_of,
)
from bouncer.gateway.relay import REFUSAL_STATUSES
from bouncer.openai_wire import dumps, models_list

log = logging.getLogger("bouncer.gateway")

DESTINATION = "x-gateway-destination-endpoint"  # the protocol's: Envoy's ORIGINAL_DST cluster reads it
REQUEST_ID = "x-bouncer-request-id"  # set on the request by the picker: how the watcher's stream finds it
PICKED_BY = "x-bouncer-picker"  # the picker that routed it: Envoy sends its watcher stream to that one
GENERATION = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE)
WATCHER_WAIT_S = 0.2  # the watcher's messages and the picker's end travel on two streams
USAGE_TAIL_BYTES = 8192  # of a stream read whole, kept for its usage event
READY_EVERY_S = 1.0


@dataclass(slots=True)
class _Served:
    """A dispatched request Envoy is serving: what the picker and the watcher share of it."""

    dispatch: Dispatch
    streaming: bool
    read_whole: bool  # its answer is read to its end (for its usage)
    sampled: bool  # one of the `answers_read_whole` (the buffered setup reads only those whole)
    line: dict[str, Any]  # its access log line
    out: Outcome = field(default_factory=lambda: Outcome(Terminal.COMPLETED, None, None))
    tail: bytearray = field(default_factory=bytearray)  # the answer's last bytes (a whole one's, not streamed)
    read_to_end: bool = False  # the answer was read to its end
    done: bool = False  # its permit went back


class Picker(ext_proc_grpc.ExternalProcessorServicer):
    """The ext_proc service. Holds no policy: the control plane decides, this translates."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.clock = plane.clock
        self._served: dict[str, _Served] = {}
        self._reading_whole = 0  # answers being read to their end now
        self._endpoints: dict[str, str] = {}  # a replica's base URL -> its ip:port
        cfg = plane.config.picker
        self._advertised = cfg.advertise or f"{cfg.host}:{cfg.port}"

    async def Process(self, _requests, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 (gRPC's name)
        # a coroutine that reads and writes the stream itself, not an async generator: a client
        # that leaves cancels exactly the await it is in, and every `finally` runs then
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("request_headers"):
            return
        try:
            if first.observability_mode:
                await self._watch(first, context)
            else:
                await self._pick(first, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:  # a bug: Envoy then fails the request as its failure mode says
            self.plane.metrics.internal_errors.inc()
            log.exception("internal error in the picker", extra={"event": "internal_error"})
            raise

    # -- the picker filter -------------------------------------------------------------------------
    async def _pick(self, first: ext_proc.ProcessingRequest, context: grpc.aio.ServicerContext) -> None:
        plane = self.plane
        # GIE's gateways stream bodies both ways (FULL_DUPLEX_STREAMED): every chunk passes
        # through here; `bouncer envoy-config`'s setup buffers the request and leaves the answer
        # to the watcher
        duplex = first.protocol_config.request_body_mode == ProcessingMode.FULL_DUPLEX_STREAMED
        headers = headers_of(first.request_headers)
        path = headers.get(":path", "").partition("?")[0]
        kind = GENERATION.get(path) if headers.get(":method") == "POST" else None
        if kind is None:
            await context.write(self._not_generation(headers, path))
            return
        rid = plane.request_id()
        line: dict[str, Any] = {"rid": rid, "path": path, "tenant": "-", "outcome": Terminal.CANCELLED.value,
                                "front": "picker"}
        t0 = self.clock()
        try:
            if first.request_headers.end_of_stream:
                refusal = plane.refuse_early(rid, Refusal(Layer.VALIDATION, Reason.INVALID_REQUEST,
                                                          "a request body is required"), line)
                line["status"] = refusal.status
                await context.write(refused(refusal))
                return
            if not duplex:  # buffered: Envoy holds the headers until the body is answered
                await context.write(ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse()))
            raw = await request_body(context)
            if raw is None:
                return  # Envoy gave up on the request (its client left before the body came)
            decision = await self._admit(rid, kind, raw, headers, line, subset_hint(first))
            if isinstance(decision, Refusal):
                line["status"] = decision.status
                await context.write(refused(decision))
                return
            await self._serve(*decision, context, line, duplex)
        finally:
            if plane.config.logging.access_log and not line.get("pending"):
                line.setdefault("status", None)
                line["duration_s"] = round(self.clock() - t0, 4)
                logs.access(line)

    async def _admit(self, rid: str, kind: str, raw: bytes, headers: CIMultiDict[str], line: dict[str, Any],
                     subset: list[str] | None) -> tuple[Parsed, Dispatch] | Refusal:
        plane = self.plane
        limit = plane.config.limits.max_body_bytes
        if len(raw) > limit:
            return plane.refuse_early(rid, Refusal(Layer.VALIDATION, Reason.BODY_TOO_LARGE,
                                                   f"request body exceeds {limit} bytes"), line)
        parsed = plane.parse(rid, kind, raw, headers, line)
        if isinstance(parsed, Refusal):
            return parsed
        if subset is not None:  # the protocol's subset hint: only these endpoints, else 503
            names = await self._replicas_at(parsed.head.model, subset)
            if not names:
                return plane.refuse_early(rid, Refusal(
                    Layer.QUEUE, Reason.NO_BACKEND, "no replica of this model is among the endpoints the gateway "
                                                    "allows for this request", 1.0), line)
            parsed = dataclasses.replace(parsed, head=dataclasses.replace(parsed.head, replicas=frozenset(names)))
        decision = await plane.admit(parsed, line)  # cancelled here: the client left while held
        return decision if isinstance(decision, Refusal) else (parsed, decision)

    async def _serve(self, parsed: Parsed, d: Dispatch, context: grpc.aio.ServicerContext, line: dict[str, Any],
                     duplex: bool) -> None:
        """Send the dispatched request where the core chose, then follow it to its end. Owns its
        permit: whatever happens here, the control plane hears how it ended (`_ended`)."""
        rid = d.request_id
        streaming = bool(parsed.body.get("stream"))
        sampled = not duplex and self._reading_whole < self.plane.config.picker.answers_read_whole
        served = self._served[rid] = _Served(d, streaming, duplex or sampled, sampled, line)
        if sampled:
            self._reading_whole += 1
        cut = False
        try:
            endpoint = await self._endpoint(self.plane.core.view.replica(d.replica).url)
            for response in self._route(parsed, d, endpoint, served.read_whole, duplex):
                await context.write(response)
            while (msg := await context.read()) is not grpc.aio.EOF:
                which = msg.WhichOneof("request")
                if which == "response_headers":
                    line["status"] = self._answered(served, msg.response_headers)
                    await context.write(ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse()))
                elif which == "response_body":  # full duplex: each chunk passes back through here
                    chunk = msg.response_body
                    self._chunk(served, chunk.body, chunk.end_of_stream)
                    await context.write(passed_back(chunk.body, chunk.end_of_stream))
                elif which == "response_trailers":
                    await context.write(ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse()))
                elif which == "request_trailers":
                    await context.write(ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse()))
        except asyncio.CancelledError:
            cut = True
            raise
        except OSError as exc:  # the replica's address would not resolve
            served.out.terminal, served.out.reason = Terminal.FAILED, Reason.UPSTREAM_ERROR
            await context.write(refused(Refusal(Layer.UPSTREAM, Reason.UPSTREAM_ERROR,
                                                 f"backend address unknown: {exc}", 1.0)))
        finally:
            # Over: completed, or its client left (unless read whole, the picker cannot tell which
            # once the replica answered). Envoy ends a stream by half-closing and resetting it at
            # once, so a reset after the replica answered is the request's end like the
            # half-close; one before, its client leaving. In the buffered setup the status and the
            # last chunk come on the watcher's stream, which may still be on its way: wait for them.
            waits = (cut and not duplex and "status" not in line) or \
                (served.sampled and served.out.terminal is Terminal.COMPLETED and not served.read_to_end)
            if waits:
                line["pending"] = True
                asyncio.get_running_loop().call_later(WATCHER_WAIT_S, self._settle, served, cut)
            else:
                self._settle(served, cut)

    def _settle(self, served: _Served, cut: bool) -> None:
        if cut and "status" not in served.line:  # cut before the replica answered: its client left
            served.out.terminal, served.out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
        self._ended(served)

    def _chunk(self, served: _Served, body: bytes, end: bool) -> None:
        """A chunk of the answer (the watcher's or, in full duplex, the picker's own)."""
        if body and served.out.first_token_at is None:
            now = self.clock()
            served.out.first_token_at = now
            # a stream's first chunk is its first token; a whole answer only says its prefill is over
            self.plane.core.started(served.dispatch.request_id, now, measured=served.streaming)
        if not served.read_whole:
            return
        served.tail += body
        if served.streaming and len(served.tail) > USAGE_TAIL_BYTES:  # the usage is in the last event
            del served.tail[:-USAGE_TAIL_BYTES]
        if served.read_to_end:
            return
        # a stream is over at its [DONE] event: its client may hang up before the body's end reaches here
        if end or (served.streaming and b"data: [DONE]" in served.tail):
            served.out.completion_tokens = usage_of(served.tail, served.streaming)
            served.read_to_end = True
            if served.line.get("pending"):  # the picker's end came first and waits for this
                self._ended(served)

    def _ended(self, served: _Served) -> None:
        """The permit goes back, once (the picker's end and the watcher's last chunk may each
        come first)."""
        if served.done:
            return
        served.done = True
        d = served.dispatch
        rid = d.request_id
        self._served.pop(rid, None)
        if served.sampled:
            self._reading_whole -= 1
        if served.read_whole and not served.read_to_end and served.out.terminal is Terminal.COMPLETED:
            # read whole, and its end never came: its client left (or its replica cut it)
            served.out.terminal, served.out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
        if served.out.first_token_at is None and served.out.terminal is Terminal.COMPLETED:
            # an answer that came whole (or whose first chunk the watcher missed): its prefill is over
            self.plane.core.started(rid, self.clock(), measured=False)
        line = served.line
        self.plane.finish(d, served.out, served.streaming, line)
        if line.pop("pending", False) and self.plane.config.logging.access_log:
            logs.access(line)

    def _route(self, parsed: Parsed, d: Dispatch, endpoint: str, read_whole: bool,
               duplex: bool) -> list[ext_proc.ProcessingResponse]:
        """The answer to the request: where it goes (the protocol's header and `envoy.lb`
        metadata), and the body as the replica must get it."""
        model = self.plane.prepared.models[d.model]
        body = parsed.body
        changed = dict(body)
        changed["model"] = model.upstream_model or model.name
        changed["max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"] = d.max_tokens
        if read_whole and body.get("stream"):
            changed["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        new = dumps(changed) if changed != body else None
        where = ext_proc.CommonResponse(clear_route_cache=True)
        where.header_mutation.set_headers.extend([set_header(DESTINATION, endpoint),
                                                  set_header(REQUEST_ID, d.request_id),
                                                  set_header(PICKED_BY, self._advertised)])
        metadata = struct_pb2.Struct()
        metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value = endpoint
        if duplex:  # the headers wait for this answer; the body goes as one streamed chunk
            body_part = ext_proc.CommonResponse()
            body_part.body_mutation.streamed_response.body = new if new is not None else parsed.raw
            body_part.body_mutation.streamed_response.end_of_stream = True
            return [ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse(response=where),
                                                dynamic_metadata=metadata),
                    ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=body_part))]
        if new is not None:
            where.body_mutation.body = new
            # buffered with its headers sent: the content length is the processor's to set
            where.header_mutation.set_headers.append(set_header("content-length", str(len(new))))
        return [ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=where),
                                            dynamic_metadata=metadata)]

    def _answered(self, served: _Served, headers: ext_proc.HttpHeaders) -> int | None:
        """The replica's response headers: anything but 200 is its failure, which the client gets
        as the replica sent it (Envoy carries the bytes: unlike the proxy, the picker cannot hold
        a request the replica refused and send it again)."""
        try:
            status = int(header_of(headers, ":status") or "0")
        except ValueError:
            status = 0
        if status != 200:
            served.out.terminal = Terminal.FAILED
            served.out.reason = Reason.UPSTREAM_REFUSED if status in REFUSAL_STATUSES else \
                Reason.UPSTREAM_REJECTED if 400 <= status < 500 else Reason.UPSTREAM_ERROR
        return status or None

    async def _endpoint(self, url: str) -> str:
        """A replica's `ip:port` (Envoy's ORIGINAL_DST cluster takes no names), resolved once."""
        endpoint = self._endpoints.get(url)
        if endpoint is None:
            u = URL(url)
            host, port = u.host or "", u.port or 80
            try:
                ipaddress.ip_address(host)
                ip = host
            except ValueError:
                infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
                ip = infos[0][4][0]
            endpoint = self._endpoints[url] = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        return endpoint

    async def _replicas_at(self, model: str, endpoints: list[str]) -> list[str]:
        """The replicas of `model` at any of `endpoints` (`ip:port`)."""
        wanted = set(endpoints)
        names = []
        for name in self.plane.core.view.replica_names(live_only=True):
            replica = self.plane.core.view.replica(name)
            if replica.model == model:
                try:
                    if await self._endpoint(replica.url) in wanted:
                        names.append(name)
                except OSError:
                    continue  # a name that does not resolve is at no endpoint
        return names

    def _not_generation(self, headers: CIMultiDict[str], path: str) -> ext_proc.ProcessingResponse:
        """What Bouncer answers itself, as the proxy does."""
        if path == "/v1/models" and headers.get(":method") == "GET":
            names = self.plane.visible_models(headers)
            if names is None:
                return plain_error(401, "invalid or missing API key", "authentication_error", "unauthenticated")
            return immediate(200, {}, dumps(models_list(names)), "models")
        return plain_error(404, f"{headers.get(':method', '')} {path}: Not Found", "invalid_request_error", "not_found")

    # -- the watcher filter ------------------------------------------------------------------------
    async def _watch(self, first: ext_proc.ProcessingRequest, context: grpc.aio.ServicerContext) -> None:
        """The first response chunk is the first token; an answer read whole gives its usage.
        Returning closes the stream: Envoy sends it nothing more."""
        served = self._served.get(header_of(first.request_headers, REQUEST_ID))
        if served is None:
            return  # not a request the picker routed (Envoy's own reply, or a path Bouncer answered)
        while (msg := await context.read()) is not grpc.aio.EOF:
            if msg.HasField("response_headers"):
                served.line["status"] = self._answered(served, msg.response_headers)
            elif msg.HasField("response_body"):
                self._chunk(served, msg.response_body.body, msg.response_body.end_of_stream)
                if not served.read_whole or served.read_to_end or served.done:
                    return


async def _keep_ready(plane: ControlPlane, servicer: health.aio.HealthServicer) -> None:
    """Readiness as `/ready` has it: every model has a replica that answers."""
    while True:
        status = health_pb2.HealthCheckResponse.SERVING if all(plane.readiness().values()) else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("readiness", SERVICE):
            await servicer.set(name, status)
        await asyncio.sleep(READY_EVERY_S)


async def serve_picker(plane: ControlPlane, host: str, port: int, ready: asyncio.Event | None = None,
                       on_listening: Callable[[], None] | None = None) -> None:
    """The picker's gRPC server (ext_proc and the standard health service) on
    `plane.config.picker`, and the control plane's endpoints on the HTTP `host:port`, until
    cancelled."""
    server = grpc.aio.server()
    ext_proc_grpc.add_ExternalProcessorServicer_to_server(Picker(plane), server)
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    cfg = plane.config.picker
    if not server.add_insecure_port(f"{cfg.host}:{cfg.port}"):
        raise OSError(f"cannot listen on {cfg.host}:{cfg.port}")
    await server.start()
    for name in HEALTH_SERVICES:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    keep_ready = asyncio.get_running_loop().create_task(_keep_ready(plane, servicer))
    try:
        await serve_http(plane, plane.http_app(), host, port, ready, on_listening)
    finally:
        keep_ready.cancel()
        await server.stop(grace=1.0)
