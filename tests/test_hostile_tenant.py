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
from bouncer.core.fleet.cache_salt import salt_of
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


# -- 2. every exit path pays what the engine did --------------------------------------------------
def _quota_fleet(bg_loop, redis_url: str, prefix: str, **fleet_kw) -> Fleet:
    quota = {"limits": [{"window": "month", "unit": "total_tokens", "limit": 1e12}]}
    return Fleet(bg_loop, [tenant("mallory", quota=quota), tenant("alice")], engines=1,
                 extra={"quotas": {"url": redis_url, "key_prefix": prefix}}, **fleet_kw)


def _spent(redis_url: str, prefix: str) -> tuple[float, float]:
    import redis

    r = redis.Redis.from_url(redis_url)
    rows = [r.hmget(k, "spent", "reserved") for k in r.scan_iter(prefix + "quota:tenant:*")]
    return sum(float(s or 0) for s, _ in rows), sum(float(v or 0) for _, v in rows)


def _engine_used(f: Fleet) -> int:
    """What the engine counted, as vLLM counts it: prompt tokens once a prefill is done, and every
    token generated, aborted requests' included."""
    server = f.engines[0][1]
    return f.call(lambda: server.engine.counters.prompt_tokens + server.engine.counters.generation_tokens)


async def _hang_up_after(url: str, key: str, chunks: int, prompt: str, max_tokens: int) -> int:
    """Stream a completion and leave after `chunks` content chunks; the chunks it read."""
    import aiohttp

    body = {"model": "demo-llm", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    read = 0
    async with aiohttp.ClientSession() as session:
        resp = await session.post(url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data:") and b'"choices":[{' in line:
                read += 1
                if read >= chunks:
                    break
        resp.close()  # its connection goes: the client hung up
    return read


def test_2_a_thousand_streams_hung_up_at_random_are_charged_what_the_engine_used(bg_loop):
    """1,000 streamed answers, each left after a random number of chunks: what the tenant's quota
    was charged equals what the engine counted (prompts and every token generated, the aborted
    ones' too) within 1%, and each hang-up paid at least what it read (the gateway asks the engine
    for usage in every chunk, and reads what arrived after its client left)."""
    import asyncio
    import random

    from bouncer.bench.loopback import RedisServer

    server = RedisServer()
    f = _quota_fleet(bg_loop, server.url, "hang:", engine_kwargs={"num_blocks": 8192, "max_num_seqs": 64},
                     speed=2.0)
    rng = random.Random(67)
    words = "the quick brown fox jumps over a lazy dog while every tenant pays for what it used".split()
    try:
        before = _engine_used(f)

        async def run() -> list[int]:
            sem = asyncio.Semaphore(32)

            async def one(i: int) -> int:
                async with sem:
                    prompt = " ".join(rng.choice(words) for _ in range(rng.randint(200, 1200)))
                    return await _hang_up_after(f.url, "mallory", rng.randint(1, 120), prompt, 128)
            return await asyncio.gather(*[one(i) for i in range(1000)])

        read = asyncio.run(run())
        assert sum(read) > 0
        poll_until(lambda: f.call(lambda: f.gateway.core.view.inflight) == 0, timeout=60, what="all ended")
        poll_until(lambda: _spent(server.url, "hang:")[1] == 0, timeout=60, what="every reservation settled")
        used = _engine_used(f) - before
        spent, _ = _spent(server.url, "hang:")
        assert spent == pytest.approx(used, rel=0.01), (spent, used)
    finally:
        f.close()
        server.stop()


def test_2_a_whole_answer_its_client_left_is_charged_the_work_done_by_then(bg_loop):
    """A client that gives up on a whole (not streamed) answer mid-way saw no usage, and neither
    did the gateway: it is charged its prompt and the tokens the core predicts were generated by
    then (or, without predictions yet, what it reserved), never nothing."""
    from bouncer.bench.loopback import RedisServer

    server = RedisServer()
    f = _quota_fleet(bg_loop, server.url, "whole:", speed=0.5)
    try:
        before = _engine_used(f)
        prompt = "a long question " * 300
        with pytest.raises(TimeoutError):
            _post(f.url + "/v1/completions", {"model": "demo-llm", "prompt": prompt, "max_tokens": 2000,
                                              "ignore_eos": True}, {"Authorization": "Bearer mallory"}, timeout=1.5)
        poll_until(lambda: f.call(lambda: f.gateway.core.view.inflight) == 0, what="the request ended")
        poll_until(lambda: _spent(server.url, "whole:")[1] == 0, what="its reservation settled")
        spent, _ = _spent(server.url, "whole:")
        server_engine = f.engines[0][1].engine
        prompt_tokens = f.call(lambda: server_engine.counters.prompt_tokens)
        assert prompt_tokens > 0 and _engine_used(f) - before > prompt_tokens  # it ran, and was aborted
        assert prompt_tokens <= spent <= prompt_tokens + 2000, (spent, prompt_tokens)
    finally:
        f.close()
        server.stop()


def test_2_an_overflow_answer_its_client_left_is_charged_what_the_provider_reports(bg_loop):
    """A whole answer diverted to an external provider goes on being computed (and billed to the
    operator) after its client leaves: the gateway reads it to its end in the background and
    settles the tenant's quota at the usage the provider reports."""
    from bouncer.bench.loopback import RedisServer
    from conftest import start_engine, start_gateway
    from servers import free_port

    server = RedisServer()
    provider, provider_server, stop_provider = start_engine(bg_loop, speed=0.5)
    quota = {"limits": [{"window": "month", "unit": "total_tokens", "limit": 1e12}]}
    cfg = {"tenants": [tenant("alice", overflow=True, quota=quota)],
           "models": [{"name": "demo-llm", "max_model_len": 8192,
                       "backends": [{"url": f"http://127.0.0.1:{free_port()}", "name": "gone"}],
                       "overflow": [{"name": "provider", "url": provider, "upstream_model": "demo-llm"}]}],
           "quotas": {"url": server.url, "key_prefix": "ovh:"},
           "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 0.5}}}
    base, plane, stop_gateway = start_gateway(bg_loop, cfg)
    try:
        with pytest.raises(TimeoutError):
            _post(base + "/v1/completions", {"model": "demo-llm", "prompt": "divert and leave", "max_tokens": 60,
                                             "ignore_eos": True}, {"Authorization": "Bearer alice"}, timeout=0.5)
        engine = provider_server.engine
        poll_until(lambda: bg_loop.call(lambda: engine.counters.generation_tokens) == 60, timeout=60,
                   what="the provider finished the answer")
        poll_until(lambda: _spent(server.url, "ovh:") == (bg_loop.call(
            lambda: engine.counters.prompt_tokens + engine.counters.generation_tokens), 0), timeout=30,
            what="settled at the provider's usage")
    finally:
        stop_gateway()
        stop_provider()
        server.stop()


# -- 3. a prompt is everything the engine reads -------------------------------------------------
def _tools(n: int) -> list[dict]:
    return [{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing " * 20,
                                              "parameters": {"type": "object", "properties": {
                                                  f"arg_{j}": {"type": "string", "description": "an argument"}
                                                  for j in range(10)}}}} for i in range(n)]


def test_3_tools_and_tool_calls_count_as_prompt_tokens(fleet, caplog):
    """A chat's tool definitions and its tool calls' arguments are prompt the engine reads: they
    count against the context (a body of tools past it is refused before any engine sees it) and
    in the charge (the gateway's count is the engine's)."""
    calls = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": "tool_0", "arguments": json.dumps(
            {"query": "x" * 500})}} for i in range(4)]}, {"role": "tool", "tool_call_id": "c0", "content": "ok"}]
    messages = [{"role": "user", "content": "hi"}, *calls]
    huge = {"model": "demo-llm", "messages": messages, "tools": _tools(1500), "max_tokens": 4}
    assert len(json.dumps(huge)) > 1_000_000
    status, _, raw = _post(fleet.url + "/v1/chat/completions", huge, {"Authorization": "Bearer alice"})
    assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded", raw[:300]
    assert not fleet.call(lambda: list(fleet.engines[0][1].received))  # never sent
    with caplog.at_level(logging.INFO):
        small = {"model": "demo-llm", "messages": messages, "tools": _tools(2), "max_tokens": 4}
        status, _, raw = _post(fleet.url + "/v1/chat/completions", small, {"Authorization": "Bearer alice"})
        assert status == 200, raw
        poll_until(lambda: any(getattr(r, "event", None) == "request" and r.outcome == "completed"
                               for r in caplog.records), what="access line")
    line = next(r.__dict__ for r in caplog.records if getattr(r, "event", None) == "request"
                and r.outcome == "completed")
    engine_prompt = json.loads(raw)["usage"]["prompt_tokens"]
    assert line["prompt_tokens"] == engine_prompt > 1000 and "prompt_tokens_counted" not in line


def test_3_images_count_as_the_models_media_tokens_and_differ_by_image():
    """An image (audio clip, video) is tokens the engine makes of its own: counted as the model's
    `media_tokens` each; two prompts that differ only by their image are different prompts to the
    prefix index."""
    from bouncer.gateway.request_parsing import request_head, with_prompt
    from bouncer.tokenizer import PromptTokenizer

    tok = PromptTokenizer()

    def chat(url: str) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is in this picture? " * 20},
            {"type": "image_url", "image_url": {"url": url}}]}]}

    def counted(body: dict, media_tokens: int):
        head = request_head("r", "chat", body, {}, tok, media_tokens)
        return with_prompt(head, "chat", body, tok, 16, media_tokens)

    text_only = counted({"model": "m", "messages": [{"role": "user", "content": "what is in this picture? " * 20}]},
                        576)
    cat, dog = counted(chat("data:image/png;base64,Y2F0"), 576), counted(chat("data:image/png;base64,ZG9n"), 576)
    assert cat.prompt_tokens - text_only.prompt_tokens > 576 and cat.prompt_tokens == dog.prompt_tokens
    assert cat.min_prompt_tokens >= 576  # the precheck's lower bound counts it too
    assert cat.block_digests[:2] == dog.block_digests[:2] and cat.block_digests != dog.block_digests


# -- 6. a client that stops reading holds nothing for long ----------------------------------------
def test_6_a_client_that_stops_reading_is_cut_off_and_buffers_little(bg_loop, caplog):
    """A client that asks for a 16 MB stream and reads none of it: the gateway reads no more than
    about a megabyte ahead of it from the backend (the rest waits in the backend's socket), and
    once its connection has taken nothing for `listen.send_timeout_s` it is cut off: its request
    ends as cancelled and its permit goes back. (Before: the gateway read the whole answer into
    memory, and the request held its permit for as long as the client kept its connection.)"""
    from conftest import start_gateway
    from misbehaving_upstream import Misbehaving

    up = Misbehaving(bg_loop)
    up.mode = "huge-stream"
    base, plane, cleanup = start_gateway(bg_loop, {
        "tenants": [tenant("mallory")], "listen": {"send_timeout_s": 1.0},
        "models": [{"name": "m", "engine": "openai", "backends": [{"url": up.url, "name": "up", "kv_blocks": 1000}]}],
        "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 2.0}}})
    host, port = base.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        poll_until(lambda: bg_loop.call(lambda: all(r.telemetry for r in plane.core.replicas.values())),
                   what="scraped")
        with caplog.at_level(logging.INFO):
            sock.connect((host, int(port)))
            body = json.dumps({"model": "m", "prompt": "a long answer", "max_tokens": 4, "stream": True}).encode()
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer mallory\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            assert sock.recv(64).startswith(b"HTTP/1.1 200")  # then it reads nothing more
            poll_until(lambda: bg_loop.call(lambda: plane.core.view.inflight) == 0, timeout=20,
                       what="the stalled client's permit back")
            poll_until(lambda: any(getattr(r, "event", None) == "request" for r in caplog.records), what="its line")
        [line] = [r.__dict__ for r in caplog.records if getattr(r, "event", None) == "request"]
        assert line["outcome"] == "cancelled" and line["reason"] == "client_disconnected"
        assert 1 <= line["completion_tokens"] < 1000  # charged what it was sent, as the chunks count it
    finally:
        sock.close()
        cleanup()
        up.close()


def test_6_a_stream_read_slowly_holds_about_a_megabyte_unread(bg_loop):
    """The upstream client stops reading a backend's connection while more than
    `STREAM_BUFFER_BYTES` of its answer waits unread, and reads on once it is taken."""
    import asyncio

    import yarl

    from bouncer.gateway.upstream import STREAM_BUFFER_BYTES, UpstreamPool
    from misbehaving_upstream import Misbehaving

    up = Misbehaving(bg_loop)
    up.mode = "huge-stream"

    async def run() -> tuple[int, int]:
        pool = UpstreamPool(5.0, 30.0)
        resp = await pool.post_json(yarl.URL(up.url + "/v1/completions"), b"{}")
        chunks = resp.chunks(30.0)
        first = await anext(chunks)
        await asyncio.sleep(1.0)  # the reader stalls
        held = resp.unread
        total = len(first) + sum([len(c) async for c in chunks])  # then reads it all
        resp.close()
        pool.close()
        return held, total

    try:
        held, total = bg_loop.run(run())
        assert total > 16_000_000 and held <= STREAM_BUFFER_BYTES + 512 * 1024, held
    finally:
        up.close()


# -- 7. an agent is its tenant's ------------------------------------------------------------------
def test_7_another_tenants_session_id_names_another_agent():
    """Mallory sending Alice's session id neither rides Alice's slot (her steps wait for one as a
    new agent's do) nor fills Alice's steps in flight (Alice's next step still goes)."""
    from bouncer.config import key_digest
    from core_helpers import dispatched, info, make_core
    from core_helpers import tenant as core_tenant

    core = make_core(tenants=[core_tenant("alice"), core_tenant("mallory")],
                     policy={"agents": {"initial": 1, "max": 1, "max_parallel": 2}})

    def step(who: str, at: float):
        request = info(who, session_id="s-1")
        request.key_digest = key_digest(f"key-{who}")
        return dispatched(core.offer(request, at))

    assert step("alice", 0.0)  # Alice's agent takes the window's one slot
    for t in (0.1, 0.2, 0.3):
        assert not step("mallory", t)  # a new agent to the window: it waits for a slot
    assert step("alice", 0.4)  # her second step in flight (max_parallel 2) is hers to send


def test_7_agents_remembered_are_bounded():
    """A flood of one-step sessions is forgotten oldest first past `max_remembered`."""
    from bouncer.config import AgentWindowConfig
    from bouncer.core.agents.window import AgentWindow

    w = AgentWindow(AgentWindowConfig(initial=4096, max=4096, idle_timeout_s=1, max_remembered=100))
    for i in range(1000):
        w.dispatched(f"s{i}", 0.0, 1, "r")
        w.finished(f"s{i}", 0.0)
    w.expire(5.0)
    assert len(w.ended) == 100 and "s999" in w.ended and "s0" not in w.ended


# -- 11. a quota store that is slow or away ---------------------------------------------------------
def _quota_gateway(bg_loop, redis_url: str, prefix: str, limit: float, **quotas) -> tuple[Fleet, str]:
    quota = {"limits": [{"window": "month", "unit": "total_tokens", "limit": limit}]}
    f = Fleet(bg_loop, [tenant("mallory", quota=quota)], engines=1, speed=8.0,
              extra={"quotas": {"url": redis_url, "key_prefix": prefix, **quotas}})
    return f, f.url + "/v1/completions"


def _one(url: str, max_tokens: int = 2) -> tuple[int, float, dict]:
    t0 = time.monotonic()
    status, _, raw = _post(url, {"model": "demo-llm", "prompt": "q", "max_tokens": max_tokens, "ignore_eos": True},
                           {"Authorization": "Bearer mallory"})
    return status, time.monotonic() - t0, json.loads(raw)


def test_11_a_frozen_quota_store_costs_one_timeout_not_one_a_request(bg_loop):
    """With Redis not answering, the first request waits out `quotas.timeout_ms`; the ones after
    it do not wait on Redis at all (fail-open), and their spend is written once it answers."""
    from bouncer.bench.loopback import RedisServer

    server = RedisServer()
    f, url = _quota_gateway(bg_loop, server.url, "slow:", 1e9, timeout_ms=500)
    try:
        before = _one(url)
        assert before[0] == 200
        server.freeze()
        answers = [_one(url) for _ in range(8)]
        assert all(status == 200 for status, _, _ in answers)
        assert max(t for _, t, _ in answers[1:]) < 0.4, [round(t, 3) for _, t, _ in answers]
        used = sum(a["usage"]["total_tokens"] for _, _, a in [before, *answers])
        assert f.gateway.quotas.unsettled >= 8 and f.gateway.quotas.backlog_lines == 1  # one line, however many
        server.thaw()
        poll_until(lambda: f.gateway.quotas.unsettled == 0, timeout=30, what="the backlog written")
        # (what is reserved may stay up to a lease: a reserve that timed out here ran once Redis thawed)
        poll_until(lambda: _spent(server.url, "slow:")[0] == used, what="every request's spend, once")
    finally:
        f.close()
        server.stop()


def test_11_failing_open_a_tenant_known_to_be_over_stays_over(bg_loop):
    """Fail-open admits while the store is away, but a tenant the last levels read showed past
    its limit is still past it: refused (429 quota_exhausted), not let through unmetered."""
    from bouncer.bench.loopback import RedisServer

    server = RedisServer()
    f, url = _quota_gateway(bg_loop, server.url, "over:", 100, timeout_ms=300)
    try:
        for _ in range(2):  # about 45 tokens each: 90 of the month's 100 spent, no room for a third
            assert _one(url, max_tokens=40)[0] == 200
        poll_until(lambda: _spent(server.url, "over:")[0] >= 80, what="settled")
        poll_until(lambda: f.call(lambda: any(row["remaining"] < 40 for row in f.gateway.quotas.report())),
                   timeout=15, what="the levels read")
        server.freeze()
        status, _, body = _one(url, max_tokens=40)
        assert status == 429 and body["error"]["code"] == "quota_exhausted", body
    finally:
        server.thaw()
        f.close()
        server.stop()


# -- rate limits settled at usage, and said in OpenAI's headers -----------------------------------
def test_token_rate_limits_are_settled_at_usage_and_answered_in_x_ratelimit_headers(bg_loop):
    """A tenant limited in tokens is charged prompt + max_tokens when a request passes and given
    back what it did not use when it ends: short answers to requests that ask for much leave the
    limit for more requests. Every answer, served or refused, carries OpenAI's `x-ratelimit-*`
    headers, which the openai SDK reads back."""
    import openai

    limit = {"tokens_per_min": 6000, "token_burst": 3000, "requests_per_s": 100, "request_burst": 100}
    f = Fleet(bg_loop, [tenant("mallory", rate_limit=limit)], engines=1, speed=8.0)
    try:
        client = openai.OpenAI(base_url=f.url + "/v1", api_key="mallory", max_retries=0)
        served = 0
        for _ in range(12):  # each asks for 1,000 tokens and uses 5: before, the 3rd was refused
            raw = client.completions.with_raw_response.create(model="demo-llm", prompt="hi", max_tokens=1000,
                                                              extra_body={"eos_after": 5})
            assert raw.parse().usage.completion_tokens == 5
            served += 1
            assert int(raw.headers["x-ratelimit-limit-tokens"]) == 3000
            assert int(raw.headers["x-ratelimit-remaining-tokens"]) <= 3000
            assert raw.headers["x-ratelimit-limit-requests"] == "100" and raw.headers["x-ratelimit-reset-requests"]
        assert served == 12
        with pytest.raises(openai.RateLimitError) as exc:  # one that asks for more than is left
            for _ in range(5):
                client.completions.create(model="demo-llm", prompt="hi", max_tokens=2900,
                                          extra_body={"eos_after": 3000})
        headers = exc.value.response.headers
        assert exc.value.code == "rate_limited_tokens"
        assert int(headers["x-ratelimit-remaining-tokens"]) < 2900 and headers["x-ratelimit-reset-tokens"].endswith("s")
    finally:
        f.close()


# -- the low ones ------------------------------------------------------------------------------------
def _reload(base: str, config: dict) -> tuple[int, dict]:
    status, _, raw = _post(base + "/admin/reload", config, {"Authorization": "Bearer admin"})
    return status, json.loads(raw)


def test_low_a_reload_cannot_send_an_environment_variable_to_a_new_url(fleet):
    """An admin key may change the config, not send the process's secrets elsewhere: a reload
    that points an overflow target's api_key_env at a variable, or a URL, start-up did not is
    refused (it takes a restart)."""
    model = fleet.config["models"][0]
    evil = {**fleet.config, "models": [{**model, "overflow": [
        {"name": "exfil", "url": "https://collector.example", "api_key_env": "HOME"}]}]}
    status, body = _reload(fleet.url, evil)
    assert status == 400 and "takes a restart" in body["error"]["message"], body
    assert _reload(fleet.url, fleet.config)[0] == 200  # an ordinary reload goes through


def test_low_a_reload_is_refused_what_start_up_refuses_behind_envoy(bg_loop):
    """The picker cannot divert (Envoy sends the body unchanged): refused at start, and now at a
    reload too (it was applied, and the overflow never worked)."""
    from aiohttp import web

    from bouncer.config import key_digest
    from bouncer.gateway.control_plane import ControlPlane
    from gateway_setup import tenant as keyed
    from servers import free_port

    config = {"tenants": [keyed("alice")], "admin_keys_sha256": [key_digest("admin")],
              "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:1", "name": "e0"}]}]}
    overflow = {**config, "models": [{**config["models"][0], "overflow": [{"name": "o", "url": "https://o.example"}]}]}
    with pytest.raises(ConfigError, match="overflow"):
        ControlPlane(parse_config(overflow), front="picker")
    port = free_port()

    async def start():
        plane = ControlPlane(parse_config(config), front="picker")
        runner = web.AppRunner(plane.http_app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner
    runner = bg_loop.run(start())
    try:
        status, body = _reload(f"http://127.0.0.1:{port}", overflow)
        assert status == 400 and "overflow" in body["error"]["message"], body
    finally:
        bg_loop.run(runner.cleanup())


def test_low_a_request_goes_out_once_even_when_its_kept_alive_connection_breaks(bg_loop):
    """A backend that closes a connection under a request (after reading it): the request fails,
    once, never resent on a fresh connection (it may have run: sent again it would run twice);
    a backend that closed a kept-alive connection while it idled is not sent anything on it."""
    import asyncio

    import yarl

    from bouncer.gateway.upstream import UpstreamError, UpstreamPool
    from servers import free_port

    port = free_port()
    seen: list[int] = []  # each request's connection, by its number
    conns = iter(range(100))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = next(conns)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                             .split(b":")[1])
                body = await reader.readexactly(length)
                seen.append(me)
                if body == b"close-now":
                    break  # read it, and hang up without an answer
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                await writer.drain()
                if body == b"then-close":
                    break  # answered, then closed: the pool must not send on it again
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def run() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        pool = UpstreamPool(2.0, 5.0)
        url = yarl.URL(f"http://127.0.0.1:{port}/v1/completions")
        try:
            (await pool.post_json(url, b"then-close")).close()
            await asyncio.sleep(0.2)  # its FIN is in, not yet read by the pool
            resp = await pool.post_json(url, b"ok")
            await resp.read(5.0)
            assert seen == [0, 1]  # the second went on a new connection, not on the closed one
            with pytest.raises(UpstreamError):
                await pool.post_json(url, b"close-now")
            assert seen == [0, 1, 1]  # sent once: not again on a fresh connection
        finally:
            pool.close()
            server.close()
            await server.wait_closed()

    bg_loop.run(run())


# -- tenants' prefix caches apart -------------------------------------------------------------------
def test_cache_salt_each_tenant_its_own_cache_and_its_own_index():
    """Each tenant's requests carry its own cache salt (a cache group's, shared), and the core's
    prefix index keys their blocks by it: a prompt another tenant sent is no cached prefix to
    route towards."""
    from bouncer.config import key_digest
    from core_helpers import dispatched, info, make_core
    from core_helpers import tenant as core_tenant

    core = make_core(tenants=[core_tenant("a"), core_tenant("b"), core_tenant("c", cache_group="shared"),
                              core_tenant("d", cache_group="shared")], replicas=2, model={"engine": "vllm"})
    digests = list(range(1, 40))

    def send(who: str, at: float):
        request = info(who, prompt=640, block_digests=list(digests))
        request.key_digest = key_digest(f"key-{who}")
        [d] = dispatched(core.offer(request, at))
        return d, core.permits.get(d.request_id)
    a, adm_a = send("a", 0.0)
    b, adm_b = send("b", 0.1)
    c, _ = send("c", 0.2)
    d, _ = send("d", 0.3)
    assert a.cache_salt and b.cache_salt and len({a.cache_salt, b.cache_salt, c.cache_salt}) == 3
    assert c.cache_salt == d.cache_salt  # one cache group: one cache
    assert adm_a.info.block_digests != adm_b.info.block_digests != digests
    replica_a = core.replicas[a.replica]
    # on a's replica its own blocks are found; b's (the same prompt) only where b went too
    assert replica_a.prefix.match(adm_a.info.block_digests, 0.4) > 0
    assert replica_a.prefix.match(adm_b.info.block_digests, 0.4) == (len(digests) if b.replica == a.replica else 0)
    off = make_core(tenants=[core_tenant("a")], model={"engine": "vllm"})
    off.reload(off.config.model_copy(update={"cache_isolation": False}), 0.0)
    [plain] = dispatched(off.offer(info("a", prompt=640, block_digests=list(digests)), 0.0))
    assert plain.cache_salt is None


def test_cache_salt_kv_events_place_a_salted_prompt_under_its_salt():
    """vLLM names a prompt's salt in its first block's extra keys: the precise index, built from
    the events, holds the chain under that salt (what a salted request matches), not unsalted."""
    from bouncer.core.fleet.blocks import chain_block_hashes
    from bouncer.core.fleet.cache_salt import salt_of, salt_root, salted
    from bouncer.core.fleet.kv_events import BlockStored, PreciseIndex
    from bouncer.kv_events_wire import decode_batch, encode_batch

    tokens = list(range(64))
    salt = salt_of("tenant-a")
    events = [BlockStored(["k0"], None, tokens[:32], 32, salt=salt), BlockStored(["k1"], "k0", tokens[32:], 32)]
    _, decoded = decode_batch(encode_batch(0.0, events))
    assert [e.salt for e in decoded] == [salt, None]
    index = PreciseIndex(16, 1000)
    index.apply(decoded, 0.0)
    ours = chain_block_hashes(tokens, 16)
    assert index.match(salted(ours, salt_root(salt))) == 4 and index.match(ours) == 0
    assert index.match(salted(ours, salt_root(salt_of("tenant-b")))) == 0


def test_cache_salt_another_tenants_cached_prompt_is_cold_for_it(fleet):
    """Through the gateway to `bouncer engine` (which keys its cache by the salt, as vLLM does):
    Alice's second request for her prompt finds it cached; Mallory's request for the same prompt
    finds nothing, and a cache_salt of Mallory's own choosing is replaced by its tenant's."""
    prompt = "the same long system prompt, word for word " * 40

    def cached(key: str, **extra) -> int:
        status, _, raw = _post(fleet.url + "/v1/completions",
                               {"model": "demo-llm", "prompt": prompt, "max_tokens": 2, **extra},
                               {"Authorization": f"Bearer {key}"})
        assert status == 200, raw
        return json.loads(raw)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("alice") > 200
    assert cached("mallory") == 0
    # a client's own salt is not the one the engine sees: its tenant's is (so it finds its own cache)
    assert cached("mallory", cache_salt="anything") > 200
    sent = fleet.call(lambda: list(fleet.engines[0][1].received))
    assert len({b["cache_salt"] for b in sent}) == 2 and "anything" not in {b["cache_salt"] for b in sent}


# -- the fuzzer: every header and body field a tenant controls, and who pays -------------------------
@pytest.mark.slow
def test_fuzzed_headers_and_bodies_are_charged_to_the_keys_tenant_and_what_the_engine_used(bg_loop):
    """Hundreds of requests with every header and body field a client controls drawn at random
    (keys of two tenants, none, wrong ones; identity and SLO headers naming the other tenant;
    sessions; steering fields; n, max_tokens, tools, streams): each tenant's quota ends up charged
    exactly the usage of the answers its own key got, a request without a valid key is charged to
    no one, and no engine sees a steering field or a max_tokens past the tenant's cap."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    from bouncer.bench.loopback import RedisServer

    server = RedisServer()
    quota = {"limits": [{"window": "month", "unit": "total_tokens", "limit": 1e12}]}
    f = Fleet(bg_loop, [tenant("alice", priority=10, quota=quota, max_tokens_cap=64, max_tokens_default=32),
                        tenant("mallory", priority=-1, quota=quota, max_tokens_cap=64, max_tokens_default=32)],
              engines=1, engine_kwargs={"num_blocks": 4096, "max_num_seqs": 64}, speed=8.0,
              limits={"max_n": 2}, extra={"quotas": {"url": server.url, "key_prefix": "fuzz:"}})
    used: dict[str, int] = {"alice": 0, "mallory": 0}
    served: dict[str, int] = {"alice": 0, "mallory": 0}
    keys = st.sampled_from(["alice", "mallory", None, "not-a-key"])
    identity = st.dictionaries(st.sampled_from(["x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id",
                                                "x-session-id", "x-parent-session-id", "x-llm-d-inference-objective",
                                                "x-bouncer-ttft-ms", "x-bouncer-ttl-ms", "api-key"]),
                               st.sampled_from(["alice", "mallory", "1", "s-1", "0.5", "x" * 300]), max_size=4)
    fields = st.fixed_dictionaries({}, optional={
        "priority": st.integers(-10, 10), "request_id": st.text(max_size=20), "cache_salt": st.text(max_size=20),
        "kv_transfer_params": st.just({"do_remote_prefill": True, "remote_host": "10.9.9.9"}),
        "max_tokens": st.integers(1, 100_000), "n": st.integers(1, 2), "stream": st.booleans(),
        "temperature": st.floats(0, 2), "user": st.sampled_from(["alice", "mallory"]),
        "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])})

    @settings(max_examples=400, phases=[Phase.generate], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(key=keys, headers=identity, extra=fields, chat=st.booleans())
    def fuzz(key, headers, extra, chat):
        body = {"model": "demo-llm", "ignore_eos": True, **extra}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"})
        if body.get("stream"):
            body["stream_options"] = {"include_usage": True}
        sent = dict(headers)
        if key is not None:
            sent["Authorization"] = f"Bearer {key}"
        path = "/v1/chat/completions" if chat else "/v1/completions"
        status, _, raw = _post(f.url + path, body, sent)
        presented = key if key is not None else headers.get("api-key")  # a bearer key goes before api-key
        owner = presented if presented in used else None
        if status == 200:
            assert owner is not None, (key, headers, raw[:200])  # only a tenant's own key gets an answer
            if body.get("stream"):
                events = [json.loads(line[6:]) for line in raw.decode().splitlines()
                          if line.startswith("data: {")]
                usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
            else:
                usage = json.loads(raw)["usage"]
            used[owner] += usage["prompt_tokens"] + usage["completion_tokens"]
            served[owner] += 1
        else:
            assert status in (400, 401, 403, 404, 413, 422, 429, 503, 529), (status, raw[:300])

    try:
        fuzz()
        assert served["alice"] and served["mallory"]
        poll_until(lambda: f.call(lambda: f.gateway.core.view.inflight + f.gateway.core.view.queued) == 0,
                   what="nothing left")
        poll_until(lambda: _spent(server.url, "fuzz:")[1] == 0, what="every reservation settled")
        import redis

        r = redis.Redis.from_url(server.url)
        spent = {}
        for k in r.scan_iter("fuzz:quota:tenant:*"):
            spent[k.decode().split(":")[3]] = float(r.hget(k, "spent") or 0)
        assert spent == {t: float(n) for t, n in used.items()}, (spent, used)
        for received in f.call(lambda: list(f.engines[0][1].received)):
            assert not {"priority", "request_id", "kv_transfer_params"} & set(received), received
            assert received["max_tokens"] <= 64 and received["cache_salt"] in {
                salt_of("alice"), salt_of("mallory")}
    finally:
        f.close()
        server.stop()
