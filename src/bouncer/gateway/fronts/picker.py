"""The endpoint-picker front: Envoy's external processor (`ext_proc`), as the Gateway API
Inference Extension's endpoint-picker protocol has it. Clients talk to Envoy; Envoy asks this
front where each request goes, and carries the bytes itself.

`bouncer envoy-config`'s setup (buffered) runs one ext_proc filter and Envoy's gRPC access log
against this one gRPC server:

- **the ext_proc stream** (request headers, the request body BUFFERED, the answer's body
  STREAMED): the body is checked and offered to the control plane. A refusal is answered as an
  ImmediateResponse (the proxy's status, OpenAI error body and headers). A held request is
  answered late: its body message is answered when the core dispatches it, with the chosen
  replica in `x-gateway-destination-endpoint` (overwriting whatever the client sent) and in the
  `envoy.lb` metadata; a client that leaves meanwhile makes Envoy cancel the stream, which
  cancels the request in the queue. A streamed answer's first chunk is its first token; the
  picker answers it and closes the stream, so Envoy carries the rest alone (a whole answer's
  stream is closed once it is routed: its first chunk would come with its end). At most
  `picker.answers_read_whole` answers at once, begun at least a tenth of a second apart, are
  read to their end instead, for their usage (the output lengths and TPOT the core learns from);
  the decode speed of the rest is learned from the engines' inter-token latency, as scraped.
- **the access log** (`StreamAccessLogs`, batched): each request's end, with the status Envoy
  sent and the flags that say whether its client left or its replica failed. That returns the
  permit. An end that never comes (an Envoy that died with requests in flight) is given up on
  after `picker.end_unseen_after_s`, and counted.

GIE's gateways set ext_proc up in full duplex instead (one filter, every body chunk both ways,
`protocol_config` says so): the picker then answers the request's headers and body once the core
dispatches it, passes each chunk of the answer back unchanged, reads every answer whole, and
the stream's end is the request's.

docs/operations/endpoint-picker.md says what each setup sees and costs. The routes Bouncer
serves itself (`/v1/models`, unknown paths) are answered here as the proxy answers them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import pathlib
import socket
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from multidict import CIMultiDict
from yarl import URL

from bouncer.config import ConfigError, PickerTLS
from bouncer.core.outcomes import Dispatch, Layer, Reason, Refusal, Terminal
from bouncer.gateway.control_plane import ControlPlane, serve_http
from bouncer.gateway.fronts import envoy_wire_pb2 as ext_proc
from bouncer.gateway.fronts.access_log_wire import access_log_service, ends_of, peer_host, status_outcome
from bouncer.gateway.fronts.ext_proc_wire import (
    SERVICE,
    BodyTooLarge,
    ext_proc_service,
    header_of,
    headers_of,
    immediate,
    passed_back,
    plain_error,
    refused,
    request_body,
    set_header,
    subset_hint,
)
from bouncer.gateway.fronts.picker_ledger import Ledger
from bouncer.gateway.parsed_request import Exchange, Parsed
from bouncer.gateway.upstream_body import upstream_body
from bouncer.openai_wire import dumps

log = logging.getLogger("bouncer.gateway")

DESTINATION = "x-gateway-destination-endpoint"  # the protocol's: Envoy's ORIGINAL_DST cluster reads it
RATELIMIT_NAMESPACE = "bouncer.ratelimit"  # dynamic metadata: the x-ratelimit-* headers Envoy adds to an answer
REQUEST_ID = "x-bouncer-request-id"  # set on the request by the picker: how its access log entry finds it
PICKED_BY = "x-bouncer-picker"  # the picker that routed it: Envoy sends its access log entry to that one
GENERATION = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
HEALTH_SERVICES = ("", "liveness", "readiness", SERVICE)
READY_EVERY_S = 1.0
SWEEP_EVERY_S = 10.0  # how often ends that never came are looked for
ENDPOINTS_KEPT = 4096  # replicas' resolved addresses kept
# the largest ext_proc message taken: a body of up to max(limits.max_body_bytes, the floor; a reload
# may raise the limit) and what goes with it (headers, metadata)
GRPC_MESSAGE_FLOOR_BYTES = 64 * 1024 * 1024
GRPC_MESSAGE_HEADROOM_BYTES = 1024 * 1024


class Picker:
    """The ext_proc service. Holds no policy: the control plane decides, this translates."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.clock = plane.clock
        self.ledger = Ledger(plane)  # the requests Envoy is serving, until their ends
        self._endpoints: dict[str, str] = {}  # a replica's base URL -> its ip:port
        cfg = plane.config.picker
        self._advertised = cfg.advertise or f"{cfg.host}:{cfg.port}"

    async def Process(self, _requests, context: grpc.aio.ServicerContext) -> None:  # noqa: N802 (gRPC's name)
        # a coroutine that reads and writes the stream itself, not an async generator: a client
        # that leaves cancels exactly the await it is in, and every `finally` runs then
        first = await context.read()
        if first is grpc.aio.EOF or not first.HasField("request_headers") or first.observability_mode:
            return
        try:
            await self._pick(first, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception:  # a bug: Envoy then fails the request as its failure mode says
            self.plane.metrics.internal_errors.inc()
            log.exception("internal error in the picker", extra={"event": "internal_error"})
            raise

    async def _pick(self, first: ext_proc.ProcessingRequest, context: grpc.aio.ServicerContext) -> None:
        plane = self.plane
        # GIE's gateways stream bodies both ways (FULL_DUPLEX_STREAMED): every chunk passes
        # through here; `bouncer envoy-config`'s setup buffers the request
        duplex = first.protocol_config.request_body_mode == ext_proc.ProcessingMode.FULL_DUPLEX_STREAMED
        headers = headers_of(first.request_headers)
        path = headers.get(":path", "").partition("?")[0]
        kind = GENERATION.get(path) if headers.get(":method") == "POST" else None
        if kind is None:
            await context.write(self._not_generation(headers, path))
            return
        ex = plane.open_exchange(path, front="picker")
        line = ex.line
        served = False
        try:
            refusal = plane.unauthenticated(ex, headers)  # before its body is sent here
            if refusal is None and first.request_headers.end_of_stream:
                refusal = plane.refuse_early(ex, Refusal(Layer.VALIDATION, Reason.INVALID_REQUEST,
                                                         "a request body is required"))
            if refusal is not None:
                line["status"] = refusal.status
                await context.write(refused(refusal))
                return
            if not duplex:  # buffered: Envoy holds the headers until the body is answered
                await context.write(ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse()))
            limit = plane.config.limits.max_body_bytes
            try:
                raw = await request_body(context, limit)
            except BodyTooLarge:
                decision: tuple[Parsed, Dispatch] | Refusal = plane.refuse_early(ex, Refusal(
                    Layer.VALIDATION, Reason.BODY_TOO_LARGE, f"request body exceeds {limit} bytes"))
            else:
                if raw is None:
                    return  # Envoy gave up on the request (its client left before the body came)
                decision = await self._admit(ex, kind, raw, headers, subset_hint(first))
            if isinstance(decision, Refusal):
                line["status"] = decision.status
                await context.write(refused(decision, plane.ratelimit_headers(line["tenant"])))
                return
            served = True
            await self._serve(*decision, context, ex, duplex, headers.get("x-request-id"))
        finally:
            if not served:  # a served one's exchange is closed at its end (`Ledger.end`)
                plane.close_exchange(ex, line.get("status"))

    async def _admit(self, ex: Exchange, kind: str, raw: bytes, headers: CIMultiDict[str],
                     subset: list[str] | None) -> tuple[Parsed, Dispatch] | Refusal:
        plane = self.plane
        parsed = plane.parse(ex, kind, raw, headers)
        if isinstance(parsed, Refusal):
            return parsed
        if subset is not None:  # the protocol's subset hint: only these endpoints, else 503
            names = await self._replicas_at(parsed.head.model, subset)
            if not names:
                return plane.refuse_early(ex, Refusal(
                    Layer.QUEUE, Reason.NO_BACKEND, "no replica of this model is among the endpoints the gateway "
                                                    "allows for this request", 1.0))
            parsed = dataclasses.replace(parsed, head=dataclasses.replace(parsed.head, replicas=frozenset(names)))
        decision = await plane.admit(ex, parsed)  # cancelled here: the client left while held
        return decision if isinstance(decision, Refusal) else (parsed, decision)

    async def _serve(self, parsed: Parsed, d: Dispatch, context: grpc.aio.ServicerContext, ex: Exchange,
                     duplex: bool, envoy_id: str | None) -> None:
        """Send the dispatched request where the core chose, and read its answer's first chunk
        (or, where it is read whole, every chunk). The request is `_served` until its end: the
        stream's in full duplex, the access log's otherwise (or its answer read to the end)."""
        streaming = bool(parsed.body.get("stream"))
        line = ex.line
        served = self.ledger.open(d, streaming, duplex, peer_host(context.peer()), envoy_id, ex)
        read_whole = served.read_whole
        cut = False
        try:
            endpoint = await self._endpoint(self.plane.replica_url(d.replica))
            for response in self._route(parsed, d, endpoint, read_whole, duplex, line):
                await context.write(response)
            if not (read_whole or streaming):
                # a whole answer's first chunk comes with its end, which the access log brings
                # anyway: closing here spares the client the round trip it would wait on
                return
            while (msg := await context.read()) is not grpc.aio.EOF:
                which = msg.WhichOneof("request")
                if which == "response_body":
                    chunk = msg.response_body
                    at = self.clock()
                    try:  # Envoy holds the chunk until it is answered: what is learnt of it waits instead
                        await context.write(passed_back(chunk.body, chunk.end_of_stream) if duplex else
                                            ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse()))
                    finally:
                        self.ledger.chunk(served, chunk.body, chunk.end_of_stream, at)
                    if not read_whole and (chunk.body or chunk.end_of_stream):
                        return  # closed: Envoy carries the rest of the answer alone
                elif which == "response_headers":  # full duplex
                    line["status"] = status = int(header_of(msg.response_headers, ":status") or "0") or None
                    served.out.terminal, served.out.reason = status_outcome(status)
                    await context.write(ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse()))
                elif which == "response_trailers":
                    await context.write(ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse()))
                elif which == "request_trailers":
                    await context.write(ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse()))
        except asyncio.CancelledError:
            cut = True
            raise
        except OSError as exc:  # the replica's address would not resolve
            served.out.terminal, served.out.reason = Terminal.FAILED, Reason.UPSTREAM_ERROR
            line["status"] = 502
            self.ledger.end(served)
            line["upstream_error"] = str(exc)  # the operator's to read: it names the replica's host
            await context.write(refused(Refusal(Layer.UPSTREAM, Reason.UPSTREAM_ERROR,
                                                 "the backend's address is not known", 1.0)))
        finally:
            if duplex:
                # Envoy ends a stream by half-closing and resetting it at once: a reset after the
                # replica answered is the request's end like the half-close; one before, its
                # client leaving
                if cut and "status" not in line:
                    served.out.terminal, served.out.reason = Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED
                self.ledger.end(served)

    def _route(self, parsed: Parsed, d: Dispatch, endpoint: str, read_whole: bool, duplex: bool,
               line: dict[str, Any]) -> list[ext_proc.ProcessingResponse]:
        """The answer to the request: where it goes (the protocol's header and `envoy.lb`
        metadata), and the body as the replica must get it."""
        model = self.plane.prepared.models[d.model]
        body = parsed.body
        changed, dropped = upstream_body(body, model.upstream_model or model.name, d.max_tokens, usage=read_whole,
                                         cache_salt=d.cache_salt)
        if dropped:
            line["dropped"] = ",".join(dropped)
        new = dumps(changed) if changed != body else None
        where = ext_proc.CommonResponse(clear_route_cache=True)
        where.header_mutation.set_headers.extend([set_header(DESTINATION, endpoint),
                                                  set_header(REQUEST_ID, d.request_id),
                                                  set_header(PICKED_BY, self._advertised)])
        metadata = struct_pb2.Struct()
        metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value = endpoint
        # the tenant's rate-limit headers: Envoy adds them to the answer (`bouncer envoy-config`'s route)
        limits = metadata.fields[RATELIMIT_NAMESPACE].struct_value.fields
        for name, value in self.plane.ratelimit_headers(d.tenant).items():
            limits[name].string_value = value
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
            if len(self._endpoints) >= ENDPOINTS_KEPT:  # replicas come and go (discovery): start over
                self._endpoints.clear()
            endpoint = self._endpoints[url] = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        return endpoint

    async def _replicas_at(self, model: str, endpoints: list[str]) -> list[str]:
        """The replicas of `model` at any of `endpoints` (`ip:port`)."""
        wanted = set(endpoints)
        names = []
        for name, url in self.plane.replicas_of(model):
            try:
                if await self._endpoint(url) in wanted:
                    names.append(name)
            except OSError:
                continue  # a name that does not resolve is at no endpoint
        return names

    def _not_generation(self, headers: CIMultiDict[str], path: str) -> ext_proc.ProcessingResponse:
        """What Bouncer answers itself, as the proxy does."""
        if path == "/v1/models" and headers.get(":method") == "GET":
            status, body = self.plane.models_answer(headers)
            return immediate(status, {}, body, "models" if status == 200 else "unauthenticated")
        return plain_error(404, f"{headers.get(':method', '')} {path}: Not Found", "invalid_request_error", "not_found")


class AccessLog:
    """Envoy's gRPC access log: each routed request's end, for the picker."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    async def StreamAccessLogs(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802 (gRPC's name)
        envoy = peer_host(context.peer())
        self.ledger.log_opened(envoy)
        try:
            async for message in request_iterator:
                for e in ends_of(message, REQUEST_ID):
                    self.ledger.ended(e, envoy)
        finally:
            self.ledger.log_closed(envoy)
        return ext_proc.StreamAccessLogsResponse()


async def _keep_ready(plane: ControlPlane, servicer: health.aio.HealthServicer) -> None:
    """Readiness as `/ready` has it: every model has a replica that answers."""
    while True:
        status = health_pb2.HealthCheckResponse.SERVING if all(plane.readiness().values()) else \
            health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("readiness", SERVICE):
            await servicer.set(name, status)
        await asyncio.sleep(READY_EVERY_S)


async def _sweep(plane: ControlPlane, ledger: Ledger) -> None:
    """Give up on ends that never came, and count them; and say which Envoys send none."""
    while True:
        await asyncio.sleep(SWEEP_EVERY_S)
        if n := ledger.give_up(plane.config.picker.end_unseen_after_s):
            plane.metrics.picker_ends_unseen.inc(n)
        plane.metrics.picker_envoys_without_access_log.set(len(ledger.envoys_without_log()))


def _credentials(tls: PickerTLS) -> grpc.ServerCredentials:
    """The picker's TLS, and with a client CA, no client without a certificate it signed."""
    def read(path: str) -> bytes:
        try:
            return pathlib.Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"picker.tls: cannot read {path}: {exc}") from None
    ca = read(tls.client_ca_file) if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(read(tls.key_file), read(tls.cert_file))], root_certificates=ca,
                                       require_client_auth=ca is not None)


async def serve_picker(plane: ControlPlane, host: str, port: int, ready: asyncio.Event | None = None,
                       on_listening: Callable[[], None] | None = None) -> None:
    """The picker's gRPC server (ext_proc, Envoy's access log and the standard health service) on
    `plane.config.picker`, and the control plane's endpoints on the HTTP `host:port`, until
    cancelled."""
    # Envoy sends a buffered body in one message: gRPC's 4 MiB default would fail the stream on a
    # body Bouncer accepts (and a failing-open Envoy then sends it on unchecked); the picker itself
    # refuses bodies over `limits.max_body_bytes` (413)
    size = max(plane.config.limits.max_body_bytes, GRPC_MESSAGE_FLOOR_BYTES) + GRPC_MESSAGE_HEADROOM_BYTES
    if plane.front != "picker":
        raise ValueError("serve_picker needs a control plane made for the picker (ControlPlane(front='picker'))")
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", size),
                                      ("grpc.max_send_message_length", size)])
    picker = Picker(plane)
    server.add_generic_rpc_handlers((ext_proc_service(picker.Process),
                                     access_log_service(AccessLog(picker.ledger).StreamAccessLogs)))
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    cfg = plane.config.picker
    where = f"{cfg.host}:{cfg.port}"
    if not (server.add_secure_port(where, _credentials(cfg.tls)) if cfg.tls else server.add_insecure_port(where)):
        raise OSError(f"cannot listen on {where}")
    await server.start()
    for name in HEALTH_SERVICES:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_keep_ready(plane, servicer)), loop.create_task(_sweep(plane, picker.ledger))]
    try:
        await serve_http(plane, plane.http_app(), host, port, ready, on_listening)
    finally:
        for task in tasks:
            task.cancel()
        await server.stop(grace=1.0)
