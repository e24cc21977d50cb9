"""A hostile tenant against the gateway: one attack per finding of issue 67, each with the answer it
must get. Each would pass on the gateway before that issue: a client that runs as another tenant,
pays less than the engine used, steers the engine, or holds what it should not.

The attacks go through real processes on loopback: the proxy front in front of `bouncer engine`
servers (`gateway_setup.Fleet`), raw sockets and the openai SDK as clients.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from bouncer.config import ConfigError, parse_config
from gateway_setup import Fleet, tenant
from servers import poll_until


@pytest.fixture
def fleet(bg_loop):
    f = Fleet(bg_loop, [tenant("alice", priority=10, slo={"ttft_s": 1.0}), tenant("mallory", priority=-1)],
              engines=1, engine_kwargs={"num_blocks": 2048, "max_num_seqs": 32}, speed=4.0)
    yield f
    f.close()


def _post(url: str, body: dict | bytes, headers: dict[str, str], timeout: float = 30) -> tuple[int, dict, bytes]:
    import urllib.error
    import urllib.request

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=raw, method="POST", headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _decisions(f: Fleet) -> dict:
    return f.call(lambda: dict(f.gateway.core.stats.decisions))


# -- 1. identity comes from the key ---------------------------------------------------------------
@pytest.mark.parametrize("header", ["x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id"])
def test_1_a_fairness_id_header_does_not_make_a_keyless_request_another_tenant(fleet, header):
    """Without `access.trust_fairness_id` (the default) the header is the client's word: a
    request with no key, or a wrong one, that names a tenant is nobody's (401)."""
    body = {"model": "demo-llm", "prompt": "hi", "max_tokens": 2}
    for auth in ({}, {"Authorization": "Bearer not-a-key"}):
        status, _, raw = _post(fleet.url + "/v1/completions", body, {header: "alice", **auth})
        assert status == 401, raw
    assert not any(k[0] == "admitted" for k in _decisions(fleet))
    # naming tenants by the header is the operator's explicit choice, for a gateway that sets it
    with pytest.raises(ConfigError, match="trust_fairness_id"):
        parse_config({**fleet.config, "tenants": [tenant("alice", fairness_ids=["alice"])]})


# -- 9. the key is checked before the body is read ------------------------------------------------
def test_9_a_keyless_request_is_refused_on_its_headers_without_its_body_being_read(fleet):
    """A request with no key gets its 401 as soon as its headers are in, without the gateway
    waiting for (or parsing) a body it announced and never sends."""
    host, port = fleet.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 4000000\r\n\r\n{\"model\":")
        t0 = time.monotonic()
        head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 401"), head[:200]
        assert time.monotonic() - t0 < 5  # the body timeout is 30 s: it did not wait for the body
    body = b"not json at all" * 1000
    status, _, raw = _post(fleet.url + "/v1/chat/completions", body, {})
    assert status == 401 and json.loads(raw)["error"]["code"] == "unauthenticated"
    poll_until(lambda: fleet.call(lambda: fleet.gateway.core.view.inflight) == 0, what="nothing in flight")


# -- 5. a reserve comes from the config, never from a header --------------------------------------
def test_5_a_tighter_slo_header_does_not_become_the_lower_bands_reserve(fleet):
    """A top-band request that says `x-bouncer-ttft-ms: 1` (or llm-d's header) tightens its own
    deadline only: the TTFT reserve the lower bands keep for its band stays its tenant's
    configured SLO (1 s here), whether the probe was served or refused."""
    body = {"model": "demo-llm", "prompt": "probe", "max_tokens": 2}
    for header in ("x-bouncer-ttft-ms", "x-llm-d-slo-ttft-ms"):
        status, _, _ = _post(fleet.url + "/v1/completions", body, {"Authorization": "Bearer alice", header: "1"})
        assert status in (200, 429)
    reserve = fleet.call(lambda: fleet.gateway.core.models["demo-llm"].band_slos.protected(0, fleet.gateway.clock()))
    assert reserve[0] == 1.0, reserve


# -- 10. what steers the engine is the gateway's --------------------------------------------------
STEERING = {"priority": -100, "request_id": "victim-request", "kv_transfer_params": {
    "do_remote_prefill": True, "remote_host": "10.0.0.66", "remote_port": 5555, "remote_engine_id": "evil",
    "remote_block_ids": [1, 2]}, "ec_transfer_params": {"remote_host": "10.0.0.66"}, "cache_salt": "another-tenant"}


@pytest.mark.parametrize("stream", [False, True])
def test_10_engine_control_fields_never_reach_the_engine_as_the_client_sent_them(fleet, stream, caplog):
    """A client's `priority` (vLLM's priority queue), `kv_transfer_params` / `ec_transfer_params`
    (a host the engine would fetch KV from), `request_id` and `cache_salt` are dropped on the way
    up; the access line names what was dropped."""
    body = {"model": "demo-llm", "prompt": "steer", "max_tokens": 3, "stream": stream, **STEERING}
    with caplog.at_level(logging.INFO):
        status, _, raw = _post(fleet.url + "/v1/completions", body, {"Authorization": "Bearer mallory"})
        assert status == 200, raw
        poll_until(lambda: any(getattr(r, "event", None) == "request" for r in caplog.records), what="access line")
    [line] = [r.__dict__ for r in caplog.records if getattr(r, "event", None) == "request"]
    assert line["dropped"] == "priority,request_id,kv_transfer_params,ec_transfer_params,cache_salt"
    server = fleet.engines[0][1]
    sent = fleet.call(lambda: list(server.received))[-1]
    assert sent["prompt"] == "steer"
    for field in STEERING:
        assert sent.get(field) != STEERING[field], (field, sent.get(field))
    assert "priority" not in sent and "request_id" not in sent and "kv_transfer_params" not in sent


# -- 8. an overflow endpoint is asked for no more than the tenant may have --------------------------
def test_8_a_diverted_request_keeps_its_tenants_token_cap(bg_loop):
    """A request diverted to an external overflow endpoint (the pool has no replica) is sent with
    the max_tokens the tenant's cap allows, not the client's: the operator pays the provider."""
    from conftest import start_engine, start_gateway
    from servers import free_port

    provider, provider_server, stop_provider = start_engine(bg_loop, speed=20.0)
    cfg = {"tenants": [tenant("alice", overflow=True, max_tokens_cap=16, max_tokens_default=16)],
           "models": [{"name": "demo-llm", "max_model_len": 8192,
                       "backends": [{"url": f"http://127.0.0.1:{free_port()}", "name": "gone"}],
                       "overflow": [{"name": "provider", "url": provider, "upstream_model": "demo-llm"}]}],
           "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 0.5}}}
    base, plane, stop_gateway = start_gateway(bg_loop, cfg)
    try:
        body = {"model": "demo-llm", "prompt": "divert me", "max_tokens": 100_000, "priority": 7}
        status, _, raw = _post(base + "/v1/completions", body, {"Authorization": "Bearer alice"})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] <= 16
        sent = bg_loop.call(lambda: list(provider_server.received))[-1]
        assert sent["max_tokens"] == 16 and "priority" not in sent
    finally:
        stop_gateway()
        stop_provider()
