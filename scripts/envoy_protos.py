"""Write the picker's own copy of the Envoy messages it speaks (ext_proc v3, the gRPC access log v3).

The picker needs a few dozen of Envoy's messages, and only some of their fields. The package that
ships Envoy's generated protos (xds-protos) also ships its own copy of opentelemetry-proto's
modules, and a `pip install` that unpacks it last breaks tracing's exporter. So Bouncer carries the
messages it uses, with the fields it reads and writes, under a package of its own
(`bouncer.envoy`: nothing it registers can clash with another package's), generated from
Envoy's own descriptors by this script: same field numbers and types, so the bytes on the wire
are Envoy's (protobuf skips the fields a message does not declare). The gRPC services are
registered by their Envoy names (`ext_proc_wire.ext_proc_service`, `access_log_wire.access_log_service`).

Run with a Python that has xds-protos (the Makefile installs it in .venv-envoy, which nothing of
Bouncer's imports):

    .venv-envoy/bin/python scripts/envoy_protos.py          # writes src/bouncer/gateway/fronts/envoy_wire.proto
    .venv/bin/python -m grpc_tools.protoc -Isrc --python_out=src --pyi_out=src \\
        src/bouncer/gateway/fronts/envoy_wire.proto          # its Python module, beside it
    .venv-envoy/bin/python scripts/envoy_protos.py --check  # exits 1 where the committed file differs

tests/test_envoy_wire.py checks both steps against what is committed.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "src/bouncer/gateway/fronts/envoy_wire.proto"

# message -> the fields kept, by Envoy's full names
MESSAGES: dict[str, list[str]] = {
    "envoy.service.ext_proc.v3.ProcessingRequest": [
        "request_headers", "response_headers", "request_body", "response_body", "request_trailers",
        "response_trailers", "metadata_context", "observability_mode", "protocol_config"],
    "envoy.service.ext_proc.v3.ProcessingResponse": [
        "request_headers", "response_headers", "request_body", "response_body", "request_trailers",
        "response_trailers", "immediate_response", "dynamic_metadata"],
    "envoy.service.ext_proc.v3.HttpHeaders": ["headers", "end_of_stream"],
    "envoy.service.ext_proc.v3.HttpBody": ["body", "end_of_stream"],
    "envoy.service.ext_proc.v3.HttpTrailers": ["trailers"],
    "envoy.service.ext_proc.v3.ProtocolConfiguration": [
        "request_body_mode", "response_body_mode", "send_body_without_waiting_for_header_response"],
    "envoy.service.ext_proc.v3.HeadersResponse": ["response"],
    "envoy.service.ext_proc.v3.BodyResponse": ["response"],
    "envoy.service.ext_proc.v3.TrailersResponse": ["header_mutation"],
    "envoy.service.ext_proc.v3.CommonResponse": [
        "status", "header_mutation", "body_mutation", "trailers", "clear_route_cache"],
    "envoy.service.ext_proc.v3.HeaderMutation": ["set_headers", "remove_headers"],
    "envoy.service.ext_proc.v3.BodyMutation": ["body", "clear_body", "streamed_response"],
    "envoy.service.ext_proc.v3.StreamedBodyResponse": ["body", "end_of_stream"],
    "envoy.service.ext_proc.v3.ImmediateResponse": ["status", "headers", "body", "details"],
    "envoy.extensions.filters.http.ext_proc.v3.ProcessingMode": [],  # for its BodySendMode enum
    "envoy.type.v3.HttpStatus": ["code"],
    "envoy.config.core.v3.HeaderMap": ["headers"],
    "envoy.config.core.v3.HeaderValue": ["key", "value", "raw_value"],
    "envoy.config.core.v3.HeaderValueOption": ["header", "append", "append_action", "keep_empty_value"],
    "envoy.config.core.v3.Metadata": ["filter_metadata"],
    "envoy.service.accesslog.v3.StreamAccessLogsMessage": ["http_logs"],
    "envoy.service.accesslog.v3.StreamAccessLogsMessage.HTTPAccessLogEntries": ["log_entry"],
    "envoy.service.accesslog.v3.StreamAccessLogsResponse": [],
    "envoy.data.accesslog.v3.HTTPAccessLogEntry": ["common_properties", "request", "response"],
    "envoy.data.accesslog.v3.AccessLogCommon": [
        "time_to_last_upstream_tx_byte", "time_to_first_upstream_rx_byte", "response_flags",
        "intermediate_log_entry"],
    "envoy.data.accesslog.v3.ResponseFlags": [  # what `access_log_wire` tells ends by
        "downstream_connection_termination", "downstream_remote_reset", "upstream_request_timeout",
        "stream_idle_timeout", "upstream_max_stream_duration_reached", "duration_timeout",
        "upstream_connection_failure", "upstream_connection_termination", "upstream_remote_reset",
        "no_healthy_upstream", "upstream_overflow", "upstream_protocol_error", "upstream_retry_limit_exceeded",
        "no_cluster_found", "dns_resolution_failure", "local_reset"],
    "envoy.data.accesslog.v3.HTTPRequestProperties": ["request_id", "request_headers"],
    "envoy.data.accesslog.v3.HTTPResponseProperties": ["response_code"],
}
# enums kept as enums (their values named); any other enum a kept field has is an int32 on the wire
ENUMS = {
    "envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode",
    "envoy.service.ext_proc.v3.CommonResponse.ResponseStatus",
    "envoy.config.core.v3.HeaderValueOption.HeaderAppendAction",
}
MODULES = [  # where xds-protos defines them
    "envoy.service.ext_proc.v3.external_processor_pb2",
    "envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2",
    "envoy.type.v3.http_status_pb2",
    "envoy.config.core.v3.base_pb2",
    "envoy.service.accesslog.v3.als_pb2",
    "envoy.data.accesslog.v3.accesslog_pb2",
]
SCALARS = {1: "double", 2: "float", 3: "int64", 4: "uint64", 5: "int32", 8: "bool", 9: "string", 12: "bytes",
           13: "uint32", 17: "sint32", 18: "sint64"}
WELL_KNOWN = {"google.protobuf.Struct": "google/protobuf/struct.proto",
              "google.protobuf.Duration": "google/protobuf/duration.proto",
              "google.protobuf.BoolValue": "google/protobuf/wrappers.proto",
              "google.protobuf.UInt32Value": "google/protobuf/wrappers.proto"}


def short(full: str) -> str:
    """Our name for one of Envoy's messages or enums: its last part (nested ones flattened to
    their last part too, but for the nested enums kept inside their message)."""
    return full.rsplit(".", 1)[-1]


def field_type(f, imports: set[str]) -> str:
    if f.type == 11:  # a message
        name = f.message_type.full_name
        if name in WELL_KNOWN:
            imports.add(WELL_KNOWN[name])
            return "." + name
        if name not in MESSAGES:
            raise SystemExit(f"{f.full_name}: type {name} is not among the messages kept")
        return short(name)
    if f.type == 14:  # an enum
        name = f.enum_type.full_name
        if name in ENUMS:
            return f"{short(f.enum_type.containing_type.full_name)}.{short(name)}"
        return "int32"  # the same varint on the wire; its values are Envoy's
    return SCALARS[f.type]


def render() -> str:
    import importlib

    from google.protobuf import descriptor_pool

    for module in MODULES:
        importlib.import_module(module)
    pool = descriptor_pool.Default()
    imports: set[str] = set()
    body = []
    for full, keep in MESSAGES.items():
        m = pool.FindMessageTypeByName(full)
        fields = [f for f in m.fields if f.name in keep]
        missing = set(keep) - {f.name for f in fields}
        if missing:
            raise SystemExit(f"{full} has no field {', '.join(sorted(missing))}")
        lines = [f"// {full}", f"message {short(full)} {{"]
        for e in m.enum_types:
            if e.full_name in ENUMS:
                lines.append(f"  enum {e.name} {{")
                lines += [f"    {v.name} = {v.number};" for v in e.values]
                lines.append("  }")
        oneofs: dict[str, list[str]] = {}
        plain = []
        for f in sorted(fields, key=lambda f: f.number):
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                text = f"map<{field_type(key, imports)}, {field_type(value, imports)}> {f.name} = {f.number};"
            else:
                label = "repeated " if f.is_repeated else ""
                text = f"{label}{field_type(f, imports)} {f.name} = {f.number};"
            group = f.containing_oneof
            if group is not None and not group.name.startswith("_"):  # (a synthetic one is proto3 optional)
                oneofs.setdefault(group.name, []).append(text)
            else:
                plain.append(text)
        lines += [f"  {t}" for t in plain]
        for name, members in oneofs.items():
            lines.append(f"  oneof {name} {{")
            lines += [f"    {t}" for t in members]
            lines.append("  }")
        lines.append("}")
        body.append("\n".join(lines))
    head = ["// Generated by scripts/envoy_protos.py from Envoy's own descriptors (xds-protos): the messages",
            "// the endpoint picker reads and writes, with the fields it uses, under a package of Bouncer's own.",
            "// Do not edit: change the script and run it again.",
            'syntax = "proto3";', "", "package bouncer.envoy;", ""]
    head += [f'import "{i}";' for i in sorted(imports)]
    return "\n".join(head) + "\n\n" + "\n\n".join(body) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with the committed file instead of writing it")
    args = ap.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(REPO)} is not what Envoy's descriptors give: run scripts/envoy_protos.py",
                  file=sys.stderr)
            sys.exit(1)
        print(f"{OUT.relative_to(REPO)}: up to date")
        return
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(REPO)}")


if __name__ == "__main__":
    main()
