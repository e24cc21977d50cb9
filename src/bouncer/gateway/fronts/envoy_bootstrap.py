"""`bouncer envoy-config`: an Envoy bootstrap that puts Bouncer's picker front in the request path.

The listener runs three HTTP filters, in order:
1. `header_mutation` drops `x-gateway-destination-endpoint`, `x-bouncer-request-id` and
   `x-bouncer-picker` from what clients send: only the picker names where a request goes, even
   when it is down and Envoy fails open. It drops llm-d's fairness-id headers too: this Envoy
   authenticates no one, so a client's own would be its word on who it is
   (`access.trust_fairness_id` is for a gateway that authenticates and sets them).
2. the picker (`ext_proc`): request headers and the whole request body; it answers the body once
   the core dispatches the request (holding is answering late). Then the answer's body, STREAMED:
   the picker answers a stream's first chunk (the first token) and closes its stream, so Envoy
   carries the rest alone (a sample of answers is read to the end, for their usage); for a whole
   answer it closes its stream once the request is routed.
   `message_timeout` is the longest a request may be held plus a margin, so Envoy never cuts a
   hold short; `failure_mode_allow` is the fail-open/fail-close choice.
3. the router. A request the picker routed carries `x-gateway-destination-endpoint` and goes to
   the ORIGINAL_DST cluster keyed on it; one without (the picker down) goes, failing open, to a
   round-robin cluster of the config's backends, or, failing closed, gets 503.

Each request the picker routed ends in Envoy's gRPC access log, sent to the picker in batches
(every `ACCESS_LOG_FLUSH_S` at most): its status and response flags (a client that left, a
replica that failed). With several pickers, one access log per picker, filtered on the
`x-bouncer-picker` header the picker sets, sends each request's end to the picker that holds its
permit.

`--body-mode duplex` writes the setup GIE's gateways and llm-d use instead: one ext_proc filter
that gets every body chunk both ways (FULL_DUPLEX_STREAMED, trailers sent), no access log (the
stream's end is the request's). In full duplex `message_timeout` does not run; the idle timeouts
below bound a hold.

The HCM's `stream_idle_timeout` and the route's `idle_timeout` are at least the longest hold too
(Envoy's defaults, 5 min and 15 s unless set, would end a long hold or a slow stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from yarl import URL

from bouncer.config import BouncerConfig
from bouncer.gateway.fronts.access_log_wire import CLIENT_LEFT_FLAGS
from bouncer.gateway.fronts.ext_proc_wire import SUBSET_NAMESPACE
from bouncer.gateway.fronts.picker import DESTINATION, PICKED_BY, RATELIMIT_NAMESPACE, REQUEST_ID

RATELIMIT_HEADERS = [f"x-ratelimit-{what}-{unit}" for unit in ("requests", "tokens") for what in ("limit", "remaining",
                                                                                                  "reset")]
# what clients may not send through this Envoy: where a request goes, the picker's own marks, and
# who it is other than by its key
CLIENTS_MAY_NOT_SEND = (DESTINATION, REQUEST_ID, PICKED_BY, "x-llm-d-inference-fairness-id",
                        "x-gateway-inference-fairness-id")

HOLD_MARGIN_S = 5.0  # past the longest queue TTL: the core ends a hold before Envoy would
IDLE_FLOOR_S = 300.0  # never below Envoy's own stream idle default
T = "type.googleapis.com/"


ACCESS_LOG_FLUSH_S = 0.02  # a request's permit comes back at most this long after its end

# the picker: the request buffered whole, the answer's body until the picker closes its stream
# (at the first chunk); GIE's gateways: every body chunk both ways through the one filter
BUFFERED = {"request_header_mode": "SEND", "request_body_mode": "BUFFERED", "response_header_mode": "SKIP",
            "response_body_mode": "STREAMED", "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"}
DUPLEX = {"request_header_mode": "SEND", "request_body_mode": "FULL_DUPLEX_STREAMED", "response_header_mode": "SEND",
          "response_body_mode": "FULL_DUPLEX_STREAMED", "request_trailer_mode": "SEND",
          "response_trailer_mode": "SEND"}


def longest_hold_s(config: BouncerConfig) -> float:
    """The longest a request may wait queued: the largest of every tenant's TTL."""
    return max([config.policy.default_ttl_s, *(t.queue_ttl_s for t in config.tenants if t.queue_ttl_s)])


def _seconds(s: float) -> str:
    return f"{s:.3f}s"


def _ext_proc(cluster: str, mode: dict[str, str], **extra: Any) -> dict[str, Any]:
    return {"@type": T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
            "processing_mode": mode, **extra}


@dataclass(frozen=True)
class PickerClientTLS:
    """Envoy's side of the picker's TLS (`picker.tls`): the CA that signed the picker's
    certificate, the name that certificate carries, and Envoy's own certificate where the picker
    asks for one (mutual TLS)."""

    ca_file: str
    server_name: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def transport_socket(self) -> dict[str, Any]:
        validation: dict[str, Any] = {"trusted_ca": {"filename": self.ca_file}}
        if self.server_name:
            validation["match_typed_subject_alt_names"] = [{"san_type": "DNS",
                                                            "matcher": {"exact": self.server_name}}]
        common: dict[str, Any] = {"alpn_protocols": ["h2"], "validation_context": validation}
        if self.cert_file:
            common["tls_certificates"] = [{"certificate_chain": {"filename": self.cert_file},
                                           "private_key": {"filename": self.key_file}}]
        tls: dict[str, Any] = {"@type": T + "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                               "common_tls_context": common}
        if self.server_name:
            tls["sni"] = self.server_name
        return {"name": "envoy.transport_sockets.tls", "typed_config": tls}


def _static_cluster(name: str, hosts: list[tuple[str, int]], http2: bool = False,
                    tls: PickerClientTLS | None = None) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name, "type": "STRICT_DNS", "connect_timeout": "5s", "lb_policy": "ROUND_ROBIN",
        "dns_lookup_family": "V4_PREFERRED",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in hosts]}]}}
    if http2:
        cluster["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": T + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}}}}
    if tls is not None:
        cluster["transport_socket"] = tls.transport_socket()
    return cluster


def _access_logs(pickers: list[str]) -> list[dict[str, Any]]:
    """The requests' ends, to the picker that routed each (one picker: the routed ones). A client
    that left while Envoy was taking the picker's answer leaves a request the picker routed but
    whose headers never got the picker's: those ends (`DC`, `DR`) go to every picker, which finds
    its own by Envoy's `x-request-id`."""
    def log(cluster: str, header: dict[str, Any]) -> dict[str, Any]:
        left = {"response_flag_filter": {"flags": list(CLIENT_LEFT_FLAGS)}}
        return {"name": "envoy.access_loggers.http_grpc",
                "filter": {"or_filter": {"filters": [{"header_filter": {"header": header}}, left]}},
                "typed_config": {
                    "@type": T + "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                    "common_config": {"log_name": "bouncer", "transport_api_version": "V3",
                                      "grpc_service": {"envoy_grpc": {"cluster_name": cluster}},
                                      "buffer_flush_interval": _seconds(ACCESS_LOG_FLUSH_S)},
                    "additional_request_headers_to_log": [REQUEST_ID]}}
    if len(pickers) == 1:
        return [log("bouncer-picker", {"name": REQUEST_ID, "present_match": True})]
    return [log(f"bouncer-picker-{i}", {"name": PICKED_BY, "string_match": {"exact": addr}})
            for i, addr in enumerate(pickers)]


def bootstrap(config: BouncerConfig, *, listen_host: str = "127.0.0.1", listen_port: int = 10000,
              pickers: list[str] | None = None, fail_open: bool = False, admin_port: int | None = 9901,
              duplex: bool = False, picker_tls: PickerClientTLS | None = None) -> dict[str, Any]:
    """The bootstrap as a dict (YAML-ready). `pickers`: each picker's `host:port` as Envoy
    reaches it (default: `picker.host:picker.port` of the config); several share the state in
    Redis (`shared_state`) and Envoy spreads its streams over them. `duplex`: the setup GIE's
    gateways and llm-d use instead, every body chunk both ways through the picker
    (FULL_DUPLEX_STREAMED, trailers sent, no access log). `picker_tls`: the picker serves TLS
    (`picker.tls`), and how Envoy checks it and proves itself to it."""
    hold = longest_hold_s(config) + HOLD_MARGIN_S
    idle = max(IDLE_FLOOR_S, hold)
    pickers = pickers or [config.picker.advertise or f"{config.picker.host}:{config.picker.port}"]
    where = [p.rpartition(":") for p in pickers]
    backends = []
    for m in config.models:
        for b in m.backends:
            u = URL(b.url)
            backends.append((u.host or "127.0.0.1", u.port or 80))
        d = m.discovery
        if d is not None and fail_open:
            if d.dns is None or d.dns.record == "SRV":
                raise ValueError(f"model {m.name!r}: failing open sends to the backends without the picker, and "
                                 f"Envoy can find them only by the A/AAAA name of a dns discovery (not "
                                 f"{d.source}); fail closed, or list them")
            backends.append((d.dns.name, d.dns.port))  # STRICT_DNS: every address the name has
    picked = {"cluster": "bouncer-picked", "timeout": "0s", "idle_timeout": _seconds(idle)}
    has_destination = {"name": DESTINATION, "present_match": True}
    # the tenant's x-ratelimit-* headers, which the picker puts in the request's metadata (an empty
    # value, a tenant without that limit, adds no header)
    ratelimit = [{"header": {"key": h, "value": f"%DYNAMIC_METADATA({RATELIMIT_NAMESPACE}:{h})%"},
                  "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"} for h in RATELIMIT_HEADERS]
    routes: list[dict[str, Any]] = [
        {"name": "picked", "match": {"prefix": "/", "headers": [has_destination]}, "route": picked,
         "response_headers_to_add": ratelimit}]
    if fail_open:
        routes.append({"name": "picker-down", "match": {"prefix": "/"},
                       "route": {"cluster": "bouncer-backends", "timeout": "0s", "idle_timeout": _seconds(idle)}})
    else:
        routes.append({"name": "picker-down", "match": {"prefix": "/"}, "direct_response": {
            "status": 503, "body": {"inline_string": '{"error":{"message":"no endpoint was picked for this request",'
                                                     '"type":"service_unavailable","code":"no_endpoint"}}'}}})
    http_filters = [
        {"name": "bouncer.strip-destination", "typed_config": {
            "@type": T + "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": {"request_mutations": [{"remove": h} for h in CLIENTS_MAY_NOT_SEND]}}},
        {"name": "bouncer.picker", "typed_config": _ext_proc(
            "bouncer-picker", DUPLEX if duplex else BUFFERED,
            failure_mode_allow=fail_open, message_timeout=_seconds(hold), max_message_timeout=_seconds(hold),
            # the picker's `envoy.lb` metadata comes back; a gateway's subset hint goes to it
            metadata_options={"receiving_namespaces": {"untyped": ["envoy.lb", RATELIMIT_NAMESPACE]},
                              "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}})},
        {"name": "envoy.filters.http.router",
         "typed_config": {"@type": T + "envoy.extensions.filters.http.router.v3.Router"}},
    ]
    listener = {
        "name": "bouncer", "address": {"socket_address": {"address": listen_host, "port_value": listen_port}},
        # the picker reads the request body whole: Envoy must buffer as much as Bouncer accepts
        "per_connection_buffer_limit_bytes": config.limits.max_body_bytes + 1024,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": {
            "@type": T + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "bouncer", "stream_idle_timeout": _seconds(idle),
            "route_config": {"name": "bouncer", "virtual_hosts": [{"name": "all", "domains": ["*"],
                                                                  "routes": routes}]},
            "http_filters": http_filters,
            "access_log": [] if duplex else _access_logs(pickers)}}]}],
    }
    clusters = [
        {"name": "bouncer-picked", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "5s",
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}},
        _static_cluster("bouncer-picker", [(host, int(port)) for host, _, port in where], http2=True, tls=picker_tls),
    ]
    if len(pickers) > 1 and not duplex:
        clusters += [_static_cluster(f"bouncer-picker-{i}", [(host, int(port))], http2=True, tls=picker_tls)
                     for i, (host, _, port) in enumerate(where)]
    if fail_open:
        clusters.append(_static_cluster("bouncer-backends", backends))
    out: dict[str, Any] = {"static_resources": {"listeners": [listener], "clusters": clusters}}
    if admin_port is not None:
        out["admin"] = {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}
    return out
