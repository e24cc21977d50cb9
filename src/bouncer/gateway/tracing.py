"""OpenTelemetry traces of requests (the config's `tracing:`; unset, nothing here runs).

Per request the proxy front makes one SERVER span, named as the GenAI semantic conventions name a
call (`chat MODEL`, `text_completion MODEL`), a child of the client's W3C `traceparent` where it
sent one. Under it:

- `bouncer.admission`, from arrival to dispatch (or to the refusal): the layer that decided, the
  outcome, the reason, the band, the tenant, the time queued;
- the upstream call, a CLIENT span to the replica, whose own context goes to the engine in
  `traceparent` (vLLM started with `--otlp-traces-endpoint` continues it);
- `bouncer.first_token`, under the upstream call, from its start to the first token.

The admission and first-token spans are made when the request ends, from the times the access
line already holds, so tracing adds no work on the way; only the upstream span is started at
dispatch, because the engine needs its id. Spans are exported in batches off the event loop
(the SDK's BatchSpanProcessor thread).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from yarl import URL

from bouncer.config import Tracing

OPERATIONS = {"chat": "chat", "completion": "text_completion"}  # gen_ai.operation.name, by endpoint
QUEUE_SPANS = 16384  # spans waiting for export; past it the SDK drops them, and logs that it does
# one export's time, its retries included: a collector that is down costs the export thread
# this per batch, and a stopping gateway at most this to send what it still holds
EXPORT_TIMEOUT_S = 3.0
_PROPAGATOR = TraceContextTextMapPropagator()


def protos_overwritten() -> str | None:
    """Why the OTLP exporter cannot load, where that is the known clash: xds-protos (Envoy's
    generated protos, which Bouncer no longer depends on, but another package of the environment
    may) ships its own, older copy of opentelemetry-proto's modules, and whichever package pip
    unpacked last wins."""
    from opentelemetry.proto.common.v1 import common_pb2

    if hasattr(common_pb2, "InstrumentationScope"):
        return None
    return ("tracing: opentelemetry-proto's modules were overwritten by xds-protos' older copy (both packages "
            "ship opentelemetry/proto); reinstall it: pip install --force-reinstall --no-deps opentelemetry-proto")


class RequestSampler(Sampler):
    """Which requests are traced: `ratio` of them, drawn here. A client's traceparent is
    continued (its trace id, its parent span) but its sampled flag decides only with
    `follow_client_sampling`, and its trace id never does (a client picks its ids: one that marks
    every request sampled, or picks ids a ratio sampler keeps, would have each request traced and
    exported at the gateway's cost). A span under one of the gateway's own follows it."""

    def __init__(self, ratio: float, follow_client: bool) -> None:
        self.ratio = ratio
        self.follow_client = follow_client

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None,
                      trace_state=None) -> SamplingResult:
        parent = trace.get_current_span(parent_context).get_span_context()
        if parent.is_valid and (not parent.is_remote or self.follow_client):
            sampled = parent.trace_flags.sampled
        else:
            sampled = random.random() < self.ratio
        return SamplingResult(Decision.RECORD_AND_SAMPLE if sampled else Decision.DROP,
                              attributes if sampled else None, parent.trace_state if parent.is_valid else None)

    def get_description(self) -> str:
        return f"RequestSampler{{{self.ratio}, follow_client={self.follow_client}}}"


class Tracer:
    """Spans of requests, exported over OTLP/gRPC to `cfg.endpoint`."""

    def __init__(self, cfg: Tracing, clock: Callable[[], float]) -> None:
        # imported here, after `prepare` has checked that its modules are whole (`protos_overwritten`)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        self.cfg = cfg
        self.clock = clock
        self.provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name}),
                                       sampler=RequestSampler(cfg.sample_ratio, cfg.follow_client_sampling))
        exporter = OTLPSpanExporter(endpoint=cfg.endpoint, insecure=cfg.endpoint.startswith("http://"),
                                    headers=cfg.headers or None, timeout=EXPORT_TIMEOUT_S)
        # a second's worth of spans at a few thousand requests/s, sent at least every second
        self.provider.add_span_processor(BatchSpanProcessor(exporter, max_queue_size=QUEUE_SPANS,
                                                            schedule_delay_millis=1000, max_export_batch_size=1024))
        self.tracer = self.provider.get_tracer("bouncer")
        # the gateway's clock is monotonic; spans take the epoch in nanoseconds
        self._epoch_ns = time.time_ns() - int(clock() * 1e9)

    def ns(self, at: float) -> int:
        return self._epoch_ns + int(at * 1e9)

    def begin(self, headers: Mapping[str, str], kind: str, path: str, at: float) -> Span:
        """The request's span, from `at` (its arrival), under the client's traceparent."""
        op = OPERATIONS[kind]
        return self.tracer.start_span(op, context=_PROPAGATOR.extract(headers), kind=SpanKind.SERVER,
                                      start_time=self.ns(at), attributes={
                                          "gen_ai.operation.name": op, "http.request.method": "POST",
                                          "url.path": path})

    def upstream(self, root: Span, kind: str, model: str, url: str, replica: str,
                 at: float) -> tuple[Span | None, str]:
        """The upstream call's span, and the header lines that carry its context to the engine.
        A request not sampled gets no span; the engine gets the trace, marked not sampled."""
        if not root.is_recording():
            carrier: dict[str, str] = {}
            _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(root))
            return None, "".join(f"{name}: {value}\r\n" for name, value in carrier.items())
        u = URL(url)
        span = self.tracer.start_span(f"{OPERATIONS[kind]} {model}", context=trace.set_span_in_context(root),
                                      kind=SpanKind.CLIENT, start_time=self.ns(at), attributes={
                                          "gen_ai.operation.name": OPERATIONS[kind], "gen_ai.request.model": model,
                                          "server.address": u.host or "", "server.port": u.port or 80,
                                          "bouncer.replica": replica})
        carrier = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return span, "".join(f"{name}: {value}\r\n" for name, value in carrier.items())

    def end_upstream(self, span: Span, dispatched: float, first_token_at: float | None, status: int | None,
                     at: float) -> None:
        if first_token_at is not None:
            self.tracer.start_span("bouncer.first_token", context=trace.set_span_in_context(span),
                                   start_time=self.ns(dispatched)).end(end_time=self.ns(first_token_at))
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=self.ns(at))

    def end(self, root: Span, line: dict[str, Any], arrived: float, at: float) -> None:
        """The request ended at `at`: its admission span and attributes, from its access line."""
        if not root.is_recording():  # not sampled: nothing to record
            return
        model = line.get("model")
        if model:
            root.update_name(f"{root.attributes.get('gen_ai.operation.name')} {model}")  # type: ignore[union-attr]
        wait = line.get("queue_wait_s")
        admitted = line.get("replica") is not None
        admission = {"bouncer.outcome": "admitted" if admitted else "refused"}
        for key in ("layer", "reason", "tenant", "band", "queue_wait_s"):
            if line.get(key) is not None:
                admission[f"bouncer.{key}"] = line[key]
        decided = arrived + wait if admitted and wait is not None else at
        self.tracer.start_span("bouncer.admission", context=trace.set_span_in_context(root),
                               start_time=self.ns(arrived), attributes=admission).end(end_time=self.ns(decided))
        attrs: dict[str, Any] = {"bouncer.request_id": line["rid"], "bouncer.outcome": line.get("outcome", "")}
        for key, name in (("model", "gen_ai.request.model"), ("prompt_tokens", "gen_ai.usage.input_tokens"),
                          ("completion_tokens", "gen_ai.usage.output_tokens"), ("tenant", "bouncer.tenant"),
                          ("band", "bouncer.band"), ("reason", "bouncer.reason"), ("layer", "bouncer.layer"),
                          ("replica", "bouncer.replica"), ("ttft_s", "bouncer.ttft_s"),
                          ("status", "http.response.status_code")):
            if line.get(key) is not None:
                attrs[name] = line[key]
        root.set_attributes(attrs)
        if (line.get("status") or 0) >= 500:
            root.set_status(Status(StatusCode.ERROR))
        root.end(end_time=self.ns(at))

    def close(self) -> None:
        """Export what is still buffered, then stop."""
        self.provider.shutdown()
