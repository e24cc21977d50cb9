"""An OTLP/gRPC trace receiver (the collector's TraceService, from the opentelemetry-proto
definitions): what `bouncer bench overhead` exports its traced gateway's spans to, and what
tests decode them with.

    python -m bouncer.bench.otlp_sink --port 4317   # counts spans, prints the count on SIGTERM
"""

from __future__ import annotations

import argparse
import signal
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class OtlpSink(trace_service_pb2_grpc.TraceServiceServicer):
    """Takes every export; `keep`: holds each span, as (its resource's service.name, the span)."""

    def __init__(self, port: int, host: str = "127.0.0.1", keep: bool = False) -> None:
        self.keep = keep
        self.spans: list = []
        self.count = 0
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        if not self.server.add_insecure_port(f"{host}:{port}"):
            raise OSError(f"cannot listen on {host}:{port}")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 (the service's method name)
        with self._lock:
            for rs in request.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), None)
                for ss in rs.scope_spans:
                    self.count += len(ss.spans)
                    if self.keep:
                        self.spans.extend((service, s) for s in ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self.server.stop(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4317)
    args = parser.parse_args()
    sink = OtlpSink(args.port)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    done.wait()
    sink.stop()
    print(f"otlp sink: {sink.count} spans", flush=True)


if __name__ == "__main__":
    main()
