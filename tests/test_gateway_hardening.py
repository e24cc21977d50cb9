"""The gateway under hostile input and misbehaving backends: one test per finding of issue #16.

Each would fail on the gateway before that issue: a leaked permit, a 500 or a text body, a
half-applied reload, a header that loosened an SLO, a socket held for ever, an unguarded
endpoint, or a retry steered badly.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from bouncer.config import key_digest, parse_config
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.outcomes import STATUS_BY_REASON, Terminal
from bouncer.core.requests import RequestInfo
from bouncer.gateway.control_plane import ControlPlane
from bouncer.gateway.request_parsing import key_digest_from_headers
from conftest import start_gateway
from gateway_setup import Fleet, tenant
from misbehaving_upstream import ANSWERS, CUT, Misbehaving
from servers import poll_until

DOCUMENTED = set(STATUS_BY_REASON.values()) | {200}


def post(url: str, body: bytes | dict, key: str | None = "alice", headers: dict | None = None, timeout: float = 30):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=raw, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def get(url: str, key: str | None = None):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def assert_openai_error(status: int, headers: dict, raw: bytes, expect: int | None = None) -> dict:
    assert status in DOCUMENTED and status != 500, (status, raw[:200])
    if expect is not None:
        assert status == expect, (status, raw[:200])
    assert headers.get("Content-Type", "").startswith("application/json"), headers
    err = json.loads(raw)["error"]
    assert err["message"] and err["type"] and err["code"], err
    return err


def idle(f) -> None:
    poll_until(lambda: f.call(lambda: f.gateway.core.view.inflight + f.gateway.core.view.queued) == 0,
               what="in-flight and queued back at 0")


@pytest.fixture
def fleet(bg_loop):
    f = Fleet(bg_loop, [tenant("alice", priority=10, slo={"ttft_s": 1.0}), tenant("free", priority=-1)],
              engines=1, engine_kwargs={"num_blocks": 2048, "max_num_seqs": 32}, speed=4.0)
    yield f
    f.close()


# -- 1. permits ------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", ["x", [1], True, {"include_usage": "yes"}])
def test_1_a_malformed_stream_options_is_400_and_leaks_no_permit(fleet, options):
    for _ in range(20):  # before the fix, each leaked one permit for ever
        code, headers, raw = post(fleet.url + "/v1/chat/completions", {
            "model": "demo-llm", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "stream_options": options}, key="free")
        err = assert_openai_error(code, headers, raw, 400)
        assert err["param"] == "stream_options"
    assert fleet.call(lambda: fleet.gateway.core.view.inflight) == 0
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0, timeout=10)
    assert client.completions.create(model="demo-llm", prompt="hi", max_tokens=2).usage.completion_tokens == 2


def _one_replica_config(**kw) -> dict:
    return {"tenants": [tenant("alice")], "admin_keys_sha256": [key_digest("admin")],
            "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:9", "name": "r0", "kv_blocks": 100}]}],
            **kw}


def test_request_ids_differ_across_gateways_and_within_one():
    """Two gateways of one fleet (or two pickers, or one restarted) never hand out the same id:
    their logs and recordings are read together."""
    async def scenario():
        one, two = ControlPlane(parse_config(_one_replica_config())), ControlPlane(parse_config(_one_replica_config()))
        ids = [one.request_id() for _ in range(3)] + [two.request_id() for _ in range(3)]
        assert len(set(ids)) == 6 and all(rid.startswith("bq-") for rid in ids)
    asyncio.run(scenario())


def test_1_a_client_leaving_in_the_turn_its_request_is_dispatched_returns_the_permit():
    async def scenario():
        gw = ControlPlane(parse_config(_one_replica_config()))
        core = gw.core
        core.observe("r0", Telemetry(at=gw.clock(), kv_usage=1.0, running=0, waiting=0), gw.clock())  # full: it queues
        info = RequestInfo("q1", key_digest("alice"), "m", 100, 10)
        task = asyncio.create_task(gw.decision("q1", lambda: core.offer(info, gw.clock())))
        await asyncio.sleep(0)
        assert core.view.queued == 1
        # room opens: the core dispatches it and its future gets the result; in that same turn,
        # before the waiting task runs again, its client disconnects
        gw.apply(core.observe("r0", Telemetry(at=gw.clock(), kv_usage=0.0, running=0, waiting=0), gw.clock()))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return core.view.inflight, core.stats.outcomes[Terminal.CANCELLED]

    assert asyncio.run(scenario()) == (0, 1)


def test_1_a_permit_the_shell_loses_is_reclaimed_counted_and_logged(bg_loop, caplog):
    f = Fleet(bg_loop, [tenant("alice")], engines=1, speed=4.0, policy={"permit_lease_s": 0.4})
    try:
        core = f.gateway.core
        info = RequestInfo("lost-1", key_digest("alice"), "demo-llm", 100, 10)
        with caplog.at_level(logging.WARNING, logger="bouncer.gateway"):
            # admitted with nobody to serve it: the events are dropped, as a bug would drop them
            f.call(lambda: core.offer(info, f.gateway.clock()))
            assert f.call(lambda: core.view.inflight) == 1
            poll_until(lambda: f.call(lambda: core.view.inflight) == 0, timeout=5, what="permit reclaimed")
            poll_until(lambda: any(getattr(r, "event", None) == "permit_reclaimed" for r in caplog.records),
                       timeout=2, what="reclaim logged")
        text = get(f.url + "/metrics")[2].decode()
        assert "bouncer_permits_reclaimed_total 1.0" in text
        # requests the gateway serves keep their permits, however long they run
        client = openai.OpenAI(base_url=f.url + "/v1", api_key="alice", max_retries=0, timeout=30)
        stream = client.completions.create(model="demo-llm", prompt="x", max_tokens=60, stream=True,
                                           extra_body={"ignore_eos": True})
        assert sum(1 for c in stream if c.choices and c.choices[0].text) == 60
        assert f.call(lambda: core.stats.reclaimed) == 1
    finally:
        f.close()


def test_1_the_engines_own_counts_reveal_permits_held_for_nothing():
    from core_helpers import dispatched, info, make_core
    core = make_core(replicas=1, policy={"inflight_drift_s": 10})
    (d,) = dispatched(core.offer(info("a"), 0.0))
    r = core.replicas[d.replica]
    for t in (5.0, 10.0):  # the engine runs nothing, yet the gateway counts one in flight there
        core.observe(r.name, Telemetry(at=t, kv_usage=0.0, running=0, waiting=0), t)
        assert r.unseen_by_engine == 1 and not r.drift_reported
    core.observe(r.name, Telemetry(at=16.0, kv_usage=0.0, running=0, waiting=0), 16.0)
    assert r.drift_reported  # lasting: 11 s
    snap = core.snapshot(16.0)["models"]["m"]["replicas"][r.name]
    assert snap["inflight_unseen_by_engine"] == 1 and snap["inflight_drift"] is True
    core.observe(r.name, Telemetry(at=17.0, kv_usage=0.0, running=1, waiting=0), 17.0)
    assert r.unseen_by_engine == 0 and not r.drift_reported


# -- 2. no 500s ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [[-1], [2**32], [1, 2, 2048], [1, True]])
def test_2_prompt_token_ids_out_of_range_are_400(fleet, prompt):
    code, headers, raw = post(fleet.url + "/v1/completions", {"model": "demo-llm", "prompt": prompt, "max_tokens": 2})
    assert assert_openai_error(code, headers, raw, 400)["param"] == "prompt"


@pytest.mark.parametrize("field,value", [
    ("temperature", "hot"), ("temperature", 3), ("top_p", -0.5), ("n", "2"),
    ("stream", "yes"), ("stop", [1, 2]), ("seed", 1.5), ("logit_bias", {"1": 500}), ("presence_penalty", [0]),
    ("max_tokens", True), ("user", 7), ("logprobs", "many"), ("ignore_eos", 1),
])
def test_2_sampling_parameters_of_the_wrong_type_are_400_not_passed_on(fleet, field, value):
    body = {"model": "demo-llm", "prompt": "hi", "max_tokens": 2, field: value}
    code, headers, raw = post(fleet.url + "/v1/completions", body)
    assert assert_openai_error(code, headers, raw, 400)["param"] == field
    assert fleet.call(lambda: fleet.gateway.core.stats.decisions.get(("admitted", "-", "-", "alice", 10), 0)) == 0


def test_2_admin_drain_with_a_model_that_is_not_a_name_is_404(fleet):
    code, headers, raw = post(fleet.url + "/admin/drain", {"model": []}, key="admin")
    assert_openai_error(code, headers, raw, 404)
    code, headers, raw = post(fleet.url + "/admin/drain", b"[not json", key="admin")
    assert_openai_error(code, headers, raw, 404)


def _misbehaving(bg_loop, **proxy_kw):
    up = Misbehaving(bg_loop)
    base, gw, cleanup = start_gateway(bg_loop, {
        "tenants": [tenant("alice", priority=10)],
        "models": [{"name": "m", "engine": "openai", "backends": [{"url": up.url, "name": "bad", "kv_blocks": 1000}]}],
        "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 2.0}, "upstream_refusal_cooldown_s": 0.05},
    }, **proxy_kw)
    poll_until(lambda: bg_loop.call(lambda: all(r.telemetry for r in gw.core.replicas.values())), what="scraped")
    yield up, base, gw
    cleanup()
    up.close()


@pytest.fixture
def misbehaving(bg_loop):
    yield from _misbehaving(bg_loop)


@pytest.fixture
def misbehaving_impatient(bg_loop):
    """The same, its proxy waiting at most 0.3 s for the backend's next byte."""
    yield from _misbehaving(bg_loop, read_timeout_s=0.3)


# what a client gets for each answer of the backend's, streaming and not
STREAM_OK = {"ok-stream", "usage-string", "usage-list", "completion-abc", "choices-null"}


@pytest.mark.parametrize("mode", sorted(set(ANSWERS) | set(CUT)))
@pytest.mark.parametrize("stream", [True, False])
def test_2_whatever_the_backend_answers_the_client_gets_an_openai_answer(bg_loop, misbehaving, mode, stream):
    up, base, gw = misbehaving
    up.mode = mode
    code, headers, raw = post(base + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4,
                                                         "stream": stream})
    if mode == "always-429":
        err = assert_openai_error(code, headers, raw, 503)
        assert err["code"] == "upstream_refused" and "Retry-After" in headers
    elif code == 200:
        if stream:
            assert mode in STREAM_OK | {"cut-mid-stream"}, (mode, raw)
            events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                      if line.startswith("data: {")]
            assert events and all(isinstance(e, dict) for e in events)
            if mode == "cut-mid-stream":
                assert events[-1]["error"]["code"] == "upstream_error"  # ended with an error event, not cut
        else:
            assert mode in STREAM_OK and isinstance(json.loads(raw), dict)  # relayed as it came
    else:
        err = assert_openai_error(code, headers, raw)
        assert code in (400, 502, 503, 504), (mode, code, err)
        if mode == "json-422":
            assert code == 400 and err["code"] == "upstream_rejected" and "temperature out of range" in err["message"]
    poll_until(lambda: bg_loop.call(lambda: gw.core.view.inflight + gw.core.view.queued) == 0, what="permit returned")


@pytest.mark.parametrize("stream", [True, False])
def test_2_a_backend_that_never_answers_times_out_as_504_and_its_connection_is_not_reused(bg_loop,
                                                                                          misbehaving_impatient,
                                                                                          stream):
    up, base, gw = misbehaving_impatient
    up.mode = "silent"
    started = time.monotonic()
    code, headers, raw = post(base + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4,
                                                         "stream": stream})
    err = assert_openai_error(code, headers, raw, 504)
    assert err["code"] == "upstream_timeout" and 0.3 <= time.monotonic() - started < 5
    poll_until(lambda: bg_loop.call(lambda: gw.core.view.inflight + gw.core.view.queued) == 0, what="permit returned")
    up.mode = "ok-stream"  # the silent connection was closed, not pooled: the next request is answered
    code, _, raw = post(base + "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True})
    assert code == 200 and b"[DONE]" in raw


def test_2_a_garbled_usage_still_completes_the_stream_for_the_openai_sdk(bg_loop, misbehaving):
    up, base, gw = misbehaving
    client = openai.OpenAI(base_url=base + "/v1", api_key="alice", max_retries=0, timeout=10)
    for mode in ("usage-string", "completion-abc", "choices-null"):
        up.mode = mode
        chunks = client.completions.create(model="m", prompt="hi", max_tokens=4, stream=True)
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0] is not None]
        assert "a" in texts
    assert bg_loop.call(lambda: gw.core.stats.outcomes[Terminal.COMPLETED]) == 3


# -- 3. reload, config check and serve: all or nothing ----------------------------------------------

def test_3_a_reload_that_cannot_load_a_tokenizer_changes_nothing(fleet, tmp_path):
    new = json.loads(json.dumps(fleet.config))
    new["admin_keys_sha256"] = [key_digest("new-admin")]
    new["models"][0]["tokenizer"] = str(tmp_path / "missing-tokenizer.json")
    before = fleet.call(lambda: (fleet.gateway.core.config, fleet.gateway.prepared))
    code, headers, raw = post(fleet.url + "/admin/reload", new, key="admin")
    err = assert_openai_error(code, headers, raw, 400)
    assert "models.0.tokenizer" in err["message"] and "missing-tokenizer.json" in err["message"]
    assert fleet.call(lambda: (fleet.gateway.core.config, fleet.gateway.prepared)) == before
    assert fleet.call(lambda: fleet.gateway.prepared.tokenizers["demo-llm"]) is not None
    assert get(fleet.url + "/admin/state", key="admin")[0] == 200  # the old admin key still works
    assert get(fleet.url + "/admin/state", key="new-admin")[0] == 401


def _bad_tokenizer_config(tmp_path) -> str:
    path = tmp_path / "bouncer.yaml"
    path.write_text(json.dumps({
        "tenants": [tenant("alice")],
        "models": [{"name": "m", "tokenizer": str(tmp_path / "nope.json"), "backends": [{"url": "http://127.0.0.1:9"}]}],
        "listen": {"port": 0}}))
    return str(path)


def test_3_config_check_loads_the_tokenizers(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bouncer", "config", "check", _bad_tokenizer_config(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "models.0.tokenizer" in proc.stderr and "nope.json" in proc.stderr


def test_3_serve_with_a_bad_tokenizer_exits_2_before_saying_it_listens(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bouncer", "serve", "--config", _bad_tokenizer_config(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "nope.json" in proc.stderr
    assert "gateway on" not in proc.stdout


# -- 4. client headers only tighten ----------------------------------------------------------------

def test_4_a_header_cannot_loosen_its_tenants_slo():
    from core_helpers import admission_of, dispatched, info, make_core
    core = make_core(tenants=[{**tenant("a"), "api_keys_sha256": [key_digest("key-a")],
                               "slo": {"ttft_s": 1.0, "tpot_s": 0.1}}])
    (loose,) = dispatched(core.offer(info("a", ttft_slo_s=600.0, tpot_slo_s=5.0), 0.0))
    assert (admission_of(core, loose).ttft_slo, admission_of(core, loose).tpot_slo) == (1.0, 0.1)
    (tight,) = dispatched(core.offer(info("a", ttft_slo_s=0.5), 0.0))
    assert admission_of(core, tight).ttft_slo == 0.5 and admission_of(core, tight).ttft_deadline == 0.5


@pytest.mark.parametrize("header", ["x-bouncer-ttft-ms", "x-bouncer-tpot-ms", "x-bouncer-ttl-ms"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-5", "soon"])
def test_4_non_finite_or_non_positive_header_values_are_400(fleet, header, value):
    code, headers, raw = post(fleet.url + "/v1/completions", {"model": "demo-llm", "prompt": "x", "max_tokens": 2},
                              headers={header: value})
    assert assert_openai_error(code, headers, raw, 400)["param"] == header


# -- 5. slow and idle sockets ------------------------------------------------------------------------

@pytest.fixture
def tight(bg_loop):
    f = Fleet(bg_loop, [tenant("alice")], engines=1, speed=4.0)
    config = dict(f.config, listen={"header_timeout_s": 0.5, "body_timeout_s": 0.5, "max_connections": 8})
    base, gw, cleanup = start_gateway(bg_loop, config)
    yield base, gw
    cleanup()
    f.close()


def _read_all(sock: socket.socket, timeout: float = 5) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        out += chunk
    return out


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def test_5_headers_that_trickle_in_are_cut_off_with_408(tight):
    base, gw = tight
    with socket.create_connection(("127.0.0.1", _port(base))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        answer = _read_all(s)
        assert time.monotonic() - t0 < 3
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer


def test_5_a_kept_alive_connection_idle_past_the_header_deadline_is_not_cut(tight, caplog):
    """The header deadline runs from a request's first byte: a connection idle between requests
    (the SDKs' pooled keep-alive connections) is not answered a 408 nobody asked for, and the
    deadline's timer raises nothing."""
    base, _ = tight
    body = json.dumps({"model": "demo-llm", "prompt": "x", "max_tokens": 2}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
               b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with caplog.at_level(logging.DEBUG), socket.create_connection(("127.0.0.1", _port(base))) as s:
        for _ in range(2):
            s.sendall(request)
            answer = _read_all(s, timeout=1.5)  # the answer, then 1.5 s idle: 3x the header deadline
            assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
            assert answer.count(b"HTTP/1.1") == 1, answer
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def test_5_a_body_that_never_completes_is_408_and_counted(tight, bg_loop):
    base, gw = tight
    with socket.create_connection(("127.0.0.1", _port(base))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer alice\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n{\"model\":")
        answer = _read_all(s)
    assert answer.startswith(b"HTTP/1.1 408") and b'"request_timeout"' in answer
    assert bg_loop.call(lambda: gw.core.stats.outcomes[Terminal.REFUSED]) == 1


def test_5_connections_past_the_cap_get_503_and_idle_ones_are_not_held_for_ever(tight, bg_loop):
    base, gw = tight
    held = [socket.create_connection(("127.0.0.1", _port(base))) for _ in range(8)]
    try:
        poll_until(lambda: bg_loop.call(lambda: gw.connections.open) == 8, what="8 open")
        with socket.create_connection(("127.0.0.1", _port(base))) as extra:
            answer = _read_all(extra)
        assert answer.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in answer
        assert b"Retry-After" in answer
    finally:
        for s in held:
            s.close()
    poll_until(lambda: bg_loop.call(lambda: gw.connections.open) == 0, what="closed")
    assert get(base + "/health")[0] == 200


def test_5_malformed_http_gets_a_json_400_and_one_log_line_without_traceback(tight, caplog):
    base, _ = tight
    with caplog.at_level(logging.DEBUG):
        for _ in range(50):
            with socket.create_connection(("127.0.0.1", _port(base))) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n")
                answer = _read_all(s)
            assert answer.split(b" ", 2)[1] == b"400" and b'"invalid_request"' in answer
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert len([r for r in caplog.records if getattr(r, "event", None) == "bad_http_request"]) == 50


# -- 6. exposure --------------------------------------------------------------------------------------

def test_6_metrics_and_models_can_be_kept_behind_keys(bg_loop):
    f = Fleet(bg_loop, [tenant("alice", models=["demo-llm"])], engines=1, speed=4.0)
    config = dict(f.config, access={"metrics_keys_sha256": [key_digest("scraper")], "models_need_key": True})
    base, gw, cleanup = start_gateway(bg_loop, config)
    try:
        for path in ("/metrics", "/v1/models"):
            assert_openai_error(*get(base + path), 401)
        assert get(base + "/metrics", key="scraper")[0] == 200 and get(base + "/metrics", key="admin")[0] == 200
        code, _, raw = get(base + "/v1/models", key="alice")
        assert code == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["demo-llm"]
        assert get(f.url + "/metrics")[0] == 200  # open unless configured
    finally:
        cleanup()
        f.close()


def test_6_presented_api_keys_are_not_kept_in_clear():
    key = "sk-" + "s3cr3t" * 8
    before = sys.getrefcount(key)
    for _ in range(3):
        assert key_digest_from_headers({"Authorization": f"Bearer {key}"}) == key_digest(key)
        assert key_digest_from_headers({"api-key": key}) == key_digest(key)
    headers = {"Authorization": "Bearer " + key}
    key_digest_from_headers(headers)
    del headers
    assert sys.getrefcount(key) == before  # no cache holds the key


def test_6_a_default_tenant_takes_keyless_and_unknown_keys_when_configured(bg_loop):
    f = Fleet(bg_loop, [tenant("alice"), tenant("load-tester", priority=-1)], engines=1, speed=4.0)
    base, gw, cleanup = start_gateway(bg_loop, dict(f.config, default_tenant="load-tester"))
    try:
        for key in (None, "sk-hardcoded-by-the-tool"):
            body = {"model": "demo-llm", "prompt": "x", "max_tokens": 2}
            code, _, raw = post(base + "/v1/completions", body, key=key)
            assert code == 200, raw
        decisions = bg_loop.call(lambda: dict(gw.core.stats.decisions))
        assert decisions[("admitted", "-", "-", "load-tester", -1)] == 2
        # unless configured, they are refused
        code, headers, raw = post(f.url + "/v1/completions", {"model": "demo-llm", "prompt": "x"}, key=None)
        assert assert_openai_error(code, headers, raw, 401)["code"] == "unauthenticated"
    finally:
        cleanup()
        f.close()


# -- 7. retries steered well -------------------------------------------------------------------------

def test_7_a_refusal_no_retry_can_escape_says_so():
    from bouncer.core.outcomes import Layer, Refusal
    from bouncer.gateway.errors import error_response
    r = error_response(Refusal(Layer.SLO, "retry_past_deadline", "too late"))
    assert r.headers["x-should-retry"] == "false" and "Retry-After" not in r.headers
    r = error_response(Refusal(Layer.FLOW, "queue_full", "full", 2.5))
    assert "x-should-retry" not in r.headers
    assert r.headers["Retry-After"] == "3" and r.headers["retry-after-ms"] == "2500"


def test_7_a_backends_own_retry_after_rests_it_that_long():
    from core_helpers import dispatched, info, make_core, observe_idle
    core = make_core(replicas=1)
    (d,) = dispatched(core.offer(info("a"), 0.0))
    replica = core.replicas[d.replica]
    core.requeue(d.request_id, 1.0, retry_after=3.0)
    assert replica.cooldown_until == pytest.approx(4.0)
    assert not dispatched(observe_idle(core, 3.9)) and dispatched(observe_idle(core, 4.0))


def test_7_a_backend_that_refuses_everything_is_not_asked_again_and_again(bg_loop, misbehaving):
    up, base, gw = misbehaving
    up.mode = "always-429"
    client = openai.OpenAI(base_url=base + "/v1", api_key="alice", max_retries=0, timeout=30)
    for _ in range(5):
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="m", prompt="hi", max_tokens=2)
        assert err.value.response.json()["error"]["code"] == "upstream_refused"
    # the first request finds out the backend refuses everything (3 refusals, honouring its
    # Retry-After of 2 s between them); the ones after it are not sent again
    assert up.posts <= 3 + 4


def test_7_an_engine_with_a_queue_cap_is_sent_what_it_takes(bg_loop):
    f = Fleet(bg_loop, [tenant("alice")], engines=1, speed=4.0,
              engine_kwargs={"num_blocks": 2048, "max_num_seqs": 8, "max_num_queued_reqs": 2},
              policy={"upstream_refusal_cooldown_s": 0.05})
    try:
        async def burst():
            c = openai.AsyncOpenAI(base_url=f.url + "/v1", api_key="alice", max_retries=0)
            return await asyncio.gather(*(c.completions.create(model="demo-llm", prompt="p", max_tokens=20,
                                                               extra_body={"ignore_eos": True}) for _ in range(30)))
        results = bg_loop.start_task(burst()).result(120)
        assert all(r.usage.completion_tokens == 20 for r in results)
        refusals = f.call(lambda: sum(f.engines[0][1].engine.counters.admission_rejections.values()))
        # it learns the cap from the first burst's refusals and then probes it now and then, rather
        # than sending everything queued at it after every rest (258 refusals for these 30 before)
        assert 0 < refusals < 60
    finally:
        f.close()


# -- 8. what the operator sees ------------------------------------------------------------------------

def test_8_a_request_held_through_a_drain_that_outlasts_its_ttl_says_draining(bg_loop):
    f = Fleet(bg_loop, [tenant("alice", queue_ttl_s=0.5)], engines=1, speed=4.0)
    try:
        post(f.url + "/admin/drain?model=demo-llm", b"", key="admin")
        code, headers, raw = post(f.url + "/v1/completions", {"model": "demo-llm", "prompt": "x", "max_tokens": 2})
        assert assert_openai_error(code, headers, raw, 503)["code"] == "draining"
    finally:
        f.close()


def test_8_ready_is_503_once_every_backend_is_dead(bg_loop):
    f = Fleet(bg_loop, [tenant("alice")], engines=1, speed=4.0)
    try:
        assert get(f.url + "/ready")[0] == 200
        f._cleanups.pop(0)()  # stop the engine
        poll_until(lambda: get(f.url + "/ready")[0] == 503, timeout=10, what="not ready")
    finally:
        f.close()


@pytest.mark.parametrize("fmt", ["logfmt", "json"])
def test_5_access_lines_written_directly_read_as_logging_writes_them_and_are_rate_limited(fmt):
    import io

    from bouncer.gateway import logs

    stream = io.StringIO()
    fields = {"rid": "bq-7", "path": "/v1/chat/completions", "tenant": "a b", "outcome": "completed", "reason": None,
              "stream": False, "band": 0, "queue_wait_s": 0.25, "status": 200, "note": 'say "hi"\n'}
    configure_handler = logs.configure("info", fmt, stream)
    try:
        logging.getLogger("bouncer.access").info("request", extra={"event": "request", **fields})
        logs.access(fields)  # the gateway's own path: not through logging
        by_logging, direct = stream.getvalue().splitlines()

        def without_ts(line: str):
            return json.loads(line) | {"ts": None} if fmt == "json" else line.split(" ", 1)[1]
        assert without_ts(direct) == without_ts(by_logging) and "reason" not in direct
        for _ in range(3 * logs.RATE_BURST):  # refusals of one kind: the burst, then dropped and counted
            logs.access(dict(fields, outcome="refused", reason="saturated", status=429))
        assert len(stream.getvalue().splitlines()) == 2 + logs.RATE_BURST
    finally:
        _unconfigure_logs()
        del configure_handler
    logs.access(fields)  # handlers changed since: through logging again, not to the old stream
    assert len(stream.getvalue().splitlines()) == 2 + logs.RATE_BURST


def test_8_access_lines_and_backend_health_are_logged(bg_loop, caplog):
    f = Fleet(bg_loop, [tenant("alice", slo={"ttft_s": 5.0})], engines=1, speed=4.0)
    try:
        with caplog.at_level(logging.INFO):
            post(f.url + "/v1/completions", {"model": "demo-llm", "prompt": "x", "max_tokens": 3})
            post(f.url + "/v1/completions", {"model": "nope", "prompt": "x"})
            post(f.url + "/v1/completions", {"model": "demo-llm", "prompt": "x", "max_tokens": 1},
                 headers={"x-session-id": "s1:sub", "x-parent-session-id": "s1"})
            f._cleanups.pop(0)()
            poll_until(lambda: any(getattr(r, "event", None) == "backend_health" for r in caplog.records),
                       timeout=10, what="backend down logged")
        lines = [r.__dict__ for r in caplog.records if getattr(r, "event", None) == "request"]
        ok, missing, step = lines
        assert ok["outcome"] == "completed" and ok["tenant"] == "alice" and ok["band"] == 0 and ok["status"] == 200
        assert "session" not in ok and (step["session"], step["parent_session"]) == ("s1:sub", "s1")
        assert ok["completion_tokens"] == 3 and ok["ttft_s"] is not None and ok["queue_wait_s"] is not None
        assert missing["outcome"] == "refused" and missing["reason"] == "model_not_found" and missing["status"] == 404
        down = next(r for r in caplog.records if getattr(r, "event", None) == "backend_health")
        assert down.healthy is False and down.replica == "e0"
    finally:
        f.close()


def test_8_the_demo_replicas_ports_are_flags(tmp_path):
    from bouncer.cli import build_parser
    args = build_parser().parse_args(["serve", "--engine-ports", "9101,9102"])
    assert args.engine_ports == (9101, 9102)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--engine-ports", "x,1"])


def test_8_the_readme_documents_the_admin_api():
    import pathlib
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    for endpoint in ("/admin/state", "/admin/drain", "/admin/undrain", "/admin/reload", "default_tenant",
                     "metrics_keys_sha256", "x-should-retry"):
        assert endpoint in readme, endpoint



def _unconfigure_logs() -> None:
    """Undo `logs.configure`: the loggers as they were, for the other tests' caplog."""
    for name in ("bouncer", "aiohttp", "aiohttp.server", "aiohttp.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)


def test_5_a_flood_of_one_kind_of_log_line_is_cut_to_a_few_a_second_and_counted():
    import io

    from bouncer.gateway.logs import RATE_BURST, RateLimit, configure

    now = [0.0]
    limit = RateLimit(clock=lambda: now[0])
    log = logging.getLogger("bouncer.test-flood")

    def record(**extra) -> logging.LogRecord:
        r = log.makeRecord(log.name, logging.INFO, __file__, 1, "request", (), None, extra=extra)
        return r
    refused = [limit.filter(record(event="request", outcome="refused", tenant="free", reason="saturated"))
               for _ in range(5000)]
    assert sum(refused) == RATE_BURST
    completed = [limit.filter(record(event="request", outcome="completed", tenant="free")) for _ in range(100)]
    assert all(completed)  # every completed request keeps its line
    other = record(event="request", outcome="refused", tenant="alice", reason="saturated")
    assert limit.filter(other)  # another tenant's lines are their own kind
    now[0] = 1.5
    nxt = record(event="request", outcome="refused", tenant="free", reason="saturated")
    assert limit.filter(nxt) and nxt.suppressed == 5000 - RATE_BURST
    # and the line says so, structured
    stream = io.StringIO()
    handler = configure("info", "logfmt", stream)
    try:
        logging.getLogger("bouncer.access").info("request", extra={"event": "request", "tenant": "a b",
                                                                  "queue_wait_s": 0.25})
        line = stream.getvalue().strip()
        assert line.count("\n") == 0 and 'tenant="a b"' in line and "queue_wait_s=0.25" in line
        assert "level=info" in line and "logger=bouncer.access" in line
        configure("info", "json", stream)
        logging.getLogger("bouncer.access").info("request", extra={"event": "request", "tenant": "t"})
        assert json.loads(stream.getvalue().strip().splitlines()[-1])["tenant"] == "t"
    finally:
        _unconfigure_logs()
        del handler
