"""The picker's own copy of Envoy's messages (`envoy_wire.proto`): what Envoy's own descriptors give,
the module protoc makes of it, the same bytes as Envoy's messages both ways, and a package that
installs whole with `pip install` (no other package's modules shipped over its tracer's).

Envoy's generated protos (xds-protos) live in .venv-envoy (`make test` installs them there):
nothing of Bouncer's imports them."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from bouncer.gateway.fronts import envoy_wire_pb2 as pb

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENVOY_PYTHON = ROOT / ".venv-envoy" / "bin" / "python"
needs_xds = pytest.mark.skipif(not ENVOY_PYTHON.exists(), reason="no .venv-envoy: `make test` builds it")


@needs_xds
def test_the_proto_is_what_envoys_descriptors_give():
    out = subprocess.run([str(ENVOY_PYTHON), str(ROOT / "scripts/envoy_protos.py"), "--check"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_module_is_what_protoc_makes_of_the_proto(tmp_path):
    from importlib import resources

    from grpc_tools import protoc

    shutil.copytree(ROOT / "src/bouncer/gateway/fronts", tmp_path / "bouncer/gateway/fronts",
                    ignore=shutil.ignore_patterns("*.py", "*.pyi", "__pycache__"))
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto, as `python -m` adds them
    assert protoc.main(["protoc", f"-I{tmp_path}", f"-I{well_known}", f"--python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", str(tmp_path / "bouncer/gateway/fronts/envoy_wire.proto")]) == 0
    for name in ("envoy_wire_pb2.py", "envoy_wire_pb2.pyi"):
        made = (tmp_path / "bouncer/gateway/fronts" / name).read_text()
        assert made == (ROOT / "src/bouncer/gateway/fronts" / name).read_text(), f"{name}: rerun protoc"


# Envoy's messages, built and read back with Envoy's own classes (xds-protos, in .venv-envoy)
ENVOY_SIDE = textwrap.dedent('''
    import json, sys
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
    from envoy.service.accesslog.v3 import als_pb2
    from envoy.config.core.v3 import base_pb2
    if sys.argv[1] == "make":
        req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=True), observability_mode=True)
        req.request_headers.headers.headers.add(key=":path", raw_value=b"/v1/chat/completions")
        req.protocol_config.request_body_mode = pm.ProcessingMode.FULL_DUPLEX_STREAMED
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields["x"].string_value = "10.0.0.1:8000"
        req.attributes["unused"].fields["kept"].string_value = "skipped by the picker"
        log = als_pb2.StreamAccessLogsMessage()
        entry = log.http_logs.log_entry.add()
        entry.request.request_id = "envoy-1"
        entry.request.request_headers["x-bouncer-request-id"] = "bq-1"
        entry.response.response_code.value = 503
        entry.common_properties.response_flags.downstream_remote_reset = True
        entry.common_properties.time_to_first_upstream_rx_byte.FromMilliseconds(350)
        print(json.dumps([req.SerializeToString().hex(), log.SerializeToString().hex()]))
    else:
        resp = ep.ProcessingResponse.FromString(bytes.fromhex(sys.argv[2]))
        body = resp.request_body.response
        opt = body.header_mutation.set_headers[0]
        print(json.dumps({"which": resp.WhichOneof("response"), "clear": body.clear_route_cache,
                          "header": [opt.header.key, opt.header.raw_value.decode()],
                          "overwrite": opt.append_action == base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                          "body": body.body_mutation.body.decode(),
                          "lb": resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields["d"].string_value,
                          "status": ep.ProcessingResponse.FromString(bytes.fromhex(sys.argv[3]))
                              .immediate_response.status.code}))
''')


@needs_xds
def test_the_same_bytes_as_envoys_messages_both_ways():
    made = subprocess.run([str(ENVOY_PYTHON), "-c", ENVOY_SIDE, "make"], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    req_hex, log_hex = json.loads(made.stdout)
    req = pb.ProcessingRequest.FromString(bytes.fromhex(req_hex))
    assert req.WhichOneof("request") == "request_headers" and req.request_headers.end_of_stream
    assert req.request_headers.headers.headers[0].raw_value == b"/v1/chat/completions" and req.observability_mode
    assert req.protocol_config.request_body_mode == pb.ProcessingMode.FULL_DUPLEX_STREAMED
    assert req.metadata_context.filter_metadata["envoy.lb.subset_hint"].fields["x"].string_value == "10.0.0.1:8000"
    [entry] = pb.StreamAccessLogsMessage.FromString(bytes.fromhex(log_hex)).http_logs.log_entry
    assert (entry.request.request_id, entry.request.request_headers["x-bouncer-request-id"]) == ("envoy-1", "bq-1")
    assert entry.response.response_code.value == 503 and entry.common_properties.response_flags.downstream_remote_reset
    assert entry.common_properties.time_to_first_upstream_rx_byte.ToMilliseconds() == 350

    from bouncer.gateway.fronts.ext_proc_wire import immediate, set_header
    ours = pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(clear_route_cache=True)))
    ours.request_body.response.header_mutation.set_headers.append(set_header("x-gateway-destination-endpoint", "e:1"))
    ours.request_body.response.body_mutation.body = b'{"model": "m"}'
    ours.dynamic_metadata.fields["envoy.lb"].struct_value.fields["d"].string_value = "e:1"
    read = subprocess.run([str(ENVOY_PYTHON), "-c", ENVOY_SIDE, "read", ours.SerializeToString().hex(),
                           immediate(429, {}, b"{}", "x").SerializeToString().hex()],
                          capture_output=True, text=True, timeout=60)
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout) == {"which": "request_body", "clear": True, "header": [
        "x-gateway-destination-endpoint", "e:1"], "overwrite": True, "body": '{"model": "m"}', "lb": "e:1",
        "status": 429}


@pytest.mark.slow
def test_pip_install_alone_gives_a_tracer_whose_spans_reach_a_collector(tmp_path):
    """`pip install .` in a new venv, nothing else: the tracing config passes its check, and a
    span reaches an OTLP receiver (before, xds-protos' copy of opentelemetry-proto's modules could
    win the unpacking and break the exporter; the Makefile patched it after the fact)."""
    from bouncer.bench.otlp_sink import OtlpSink
    from servers import free_port

    src = tmp_path / "src"
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copy(ROOT / "README.md", src)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    install = subprocess.run([str(venv / "bin/pip"), "install", "-q", str(src)], capture_output=True, text=True,
                             timeout=900, env=env)
    assert install.returncode == 0, install.stderr[-3000:]
    listed = subprocess.run([str(venv / "bin/pip"), "list", "--format", "freeze"], capture_output=True, text=True,
                            check=True).stdout.lower()
    assert "xds-protos" not in listed
    port = free_port()
    sink = OtlpSink(port, keep=True)
    try:
        script = textwrap.dedent(f'''
            from bouncer.config import Tracing
            from bouncer.gateway.tracing import Tracer, protos_overwritten
            assert protos_overwritten() is None
            tracer = Tracer(Tracing(endpoint="http://127.0.0.1:{port}", service_name="pip-installed"),
                            __import__("time").monotonic)
            span = tracer.begin({{}}, "chat", "/v1/chat/completions", 0.0)
            span.end()
            assert tracer.provider.force_flush(20_000)
        ''')
        ran = subprocess.run([str(venv / "bin/python"), "-c", script], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr[-3000:]
        deadline = time.monotonic() + 10
        while not any(service == "pip-installed" for service, _ in sink.spans) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(service == "pip-installed" for service, _ in sink.spans)
    finally:
        sink.stop()
