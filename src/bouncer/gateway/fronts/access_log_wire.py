"""Envoy's gRPC access log (`envoy.service.accesslog.v3`, in Bouncer's own copy of its messages:
`envoy_wire.proto`) as the picker reads it: how each request Envoy served ended.

In the buffered setup the picker's own ext_proc stream closes at an answer's first chunk, so the
end of the answer reaches the picker here instead, in batches: the status Envoy sent and its
response flags, which tell a completed answer from a client that left (`DC`, a downstream reset)
and from a replica that failed (`UC`, `UF`, `UR`, `UT`...)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import unquote

import grpc

from bouncer.core.outcomes import Reason, Terminal
from bouncer.gateway.fronts import envoy_wire_pb2 as pb
from bouncer.gateway.relay import failure_reason

# the response flags that say the replica, or Envoy's way to it, failed the answer
_UPSTREAM_FAILED = ("upstream_connection_failure", "upstream_connection_termination", "upstream_remote_reset",
                    "no_healthy_upstream", "upstream_overflow", "upstream_protocol_error",
                    "upstream_retry_limit_exceeded", "no_cluster_found", "dns_resolution_failure", "local_reset")
_UPSTREAM_TIMED_OUT = ("upstream_request_timeout", "stream_idle_timeout", "upstream_max_stream_duration_reached",
                       "duration_timeout")
_CLIENT_LEFT = ("downstream_connection_termination", "downstream_remote_reset")
CLIENT_LEFT_FLAGS = ("DC", "DR")
SERVICE = "envoy.service.accesslog.v3.AccessLogService"  # the same, as Envoy's access log filters name them


@dataclass(frozen=True, slots=True)
class Ended:
    """One request's end as Envoy logged it."""

    # the picker's id (`x-bouncer-request-id`), or None where the request never got the
    # picker's headers: a client that left while Envoy was taking the picker's answer
    request_id: str | None
    envoy_request_id: str  # Envoy's own (`x-request-id`), which the picker saw with the headers
    status: int | None  # what Envoy sent the client; None where it sent nothing
    terminal: Terminal
    reason: Reason | None
    # from the request's last byte sent to the replica to the answer's first byte back: for a
    # whole answer, how long it took to come (its "first token", which the picker did not see)
    answered_after_s: float | None = None


def _answered_after(common: pb.AccessLogCommon) -> float | None:
    if not (common.HasField("time_to_last_upstream_tx_byte") and common.HasField("time_to_first_upstream_rx_byte")):
        return None
    gap = common.time_to_first_upstream_rx_byte.ToNanoseconds() - common.time_to_last_upstream_tx_byte.ToNanoseconds()
    return max(0.0, gap / 1e9)


def status_outcome(status: int | None) -> tuple[Terminal, Reason | None]:
    """An answer by its status alone: anything but 200 is the replica's failure."""
    if status == 200:
        return Terminal.COMPLETED, None
    return Terminal.FAILED, failure_reason(status)


def ended(entry: pb.HTTPAccessLogEntry, id_header: str) -> Ended | None:
    """How the request of one log entry ended; None for an entry that is not a stream's end, or
    names no request of the picker's (Envoy's own replies, routes the picker answered itself)
    and is no client's leaving."""
    rid = entry.request.request_headers.get(id_header) or None
    common = entry.common_properties
    if common.intermediate_log_entry:
        return None
    envoy_id = entry.request.request_id
    status = entry.response.response_code.value if entry.response.HasField("response_code") else None
    status = status or None
    flags = common.response_flags
    if any(getattr(flags, f) for f in _CLIENT_LEFT):
        return Ended(rid, envoy_id, status, Terminal.CANCELLED, Reason.CLIENT_DISCONNECTED)
    if rid is None:
        return None
    if any(getattr(flags, f) for f in _UPSTREAM_TIMED_OUT):
        return Ended(rid, envoy_id, status, Terminal.FAILED, Reason.UPSTREAM_TIMEOUT)
    if any(getattr(flags, f) for f in _UPSTREAM_FAILED):
        return Ended(rid, envoy_id, status, Terminal.FAILED, Reason.UPSTREAM_ERROR)
    return Ended(rid, envoy_id, status, *status_outcome(status), _answered_after(common))


def ends_of(message: pb.StreamAccessLogsMessage, id_header: str) -> Iterator[Ended]:
    for entry in message.http_logs.log_entry:
        if (e := ended(entry, id_header)) is not None:
            yield e


def peer_host(peer: str) -> str:
    """The host of a gRPC peer (`ipv4:10.0.0.7:51234`, `ipv6:[::1]:51234`): which Envoy asked."""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return unquote(rest).rpartition(":")[0].strip("[]")  # newer gRPC escapes IPv6 brackets


def access_log_service(stream: Callable) -> grpc.GenericRpcHandler:
    """Envoy's AccessLogService, its one client-streaming method served by `stream`."""
    return grpc.method_handlers_generic_handler(SERVICE, {"StreamAccessLogs": grpc.stream_unary_rpc_method_handler(
        stream, request_deserializer=pb.StreamAccessLogsMessage.FromString,
        response_serializer=pb.StreamAccessLogsResponse.SerializeToString)})
