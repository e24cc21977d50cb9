"""Quotas and overflow, live: real `redis-server`s the tests start, real gateways (two sharing one
Redis, or `bouncer serve` processes a test kills), `bouncer engine` replicas, and the openai SDK
as the client.

- 200 concurrent streamed requests of one tenant, spread over two gateways, against a budget for
  about 50: the spend ends within 2% of the budget, never over (each reservation is one atomic
  step in Redis: no check-then-spend race);
- a gateway killed mid-stream: its reservation is given back once its lease runs out;
- Redis restarted from its append-only file keeps the month's spend;
- a saturated primary diverts the tenant allowed to overflow to a second engine standing in for
  a provider, and refuses the other tenant; nothing is lost.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import redis
import yaml

from bouncer.bench.loopback import RedisServer
from bouncer.config import key_digest
from bouncer.tokenizer import default_tokenizer_path
from conftest import start_engine, start_gateway
from servers import BackgroundLoop, EngineProcess, free_port, poll_until, wait_http_ok

PROMPT = [{"role": "user", "content": "Count the sheep in the field, please."}]
ANSWER_TOKENS = 20


def _tenant(name: str, **kw) -> dict:
    return {"name": name, "api_keys_sha256": [key_digest(name)], **kw}


def _model(backends: list[str], **kw) -> dict:
    return {"name": "demo-llm", "engine": "vllm", "tokenizer": str(default_tokenizer_path()), "max_model_len": 4096,
            "backends": [{"url": url, "name": f"e{i}"} for i, url in enumerate(backends)], **kw}


def _levels(url: str, prefix: str) -> dict[str, tuple[float, float]]:
    r = redis.Redis.from_url(url)
    out = {}
    for key in r.scan_iter(prefix + "quota:tenant:*"):
        spent, reserved = r.hmget(key, "spent", "reserved")
        out[key.decode()] = (float(spent or 0), float(reserved or 0))
    return out


def _state(base: str) -> dict:
    req = urllib.request.Request(base + "/admin/state", headers={"Authorization": "Bearer admin"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


async def _stream(base: str, key: str, **kw) -> tuple[int, str | None, int]:
    """(status, error code, content chunks) of one streamed chat request, the SDK not retrying."""
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)
    try:
        stream = await client.chat.completions.create(model="demo-llm", messages=PROMPT, max_tokens=ANSWER_TOKENS,
                                                      stream=True, extra_body={"ignore_eos": True}, **kw)
        chunks = 0
        async for chunk in stream:
            chunks += bool(chunk.choices and chunk.choices[0].delta.content)
        return 200, None, chunks
    except openai.APIStatusError as exc:
        return exc.status_code, (exc.body or {}).get("code") if isinstance(exc.body, dict) else None, 0
    finally:
        await client.close()


def test_200_concurrent_streams_over_two_gateways_spend_within_2_percent_of_the_budget_never_over():
    server = RedisServer()
    bg = BackgroundLoop()
    cleanups = []
    try:
        engine, _, stop_engine = start_engine(bg, speed=20.0, num_blocks=8192, max_num_seqs=256)
        cleanups.append(stop_engine)
        # one request's cost, measured through a gateway without quotas (the tokenizer's count of
        # the chat prompt, plus the 20 tokens it asks for exactly)
        probe_cfg = {"tenants": [_tenant("team")], "models": [_model([engine])]}
        probe, probe_plane, stop_probe = start_gateway(bg, probe_cfg)
        assert asyncio.run(_stream(probe, "team"))[0] == 200
        served = probe_plane.core.view.stats.served_tokens["team"]
        stop_probe()
        budget = 50.5 * served  # room for 50 requests, not 51
        cfg = {"tenants": [_tenant("team", quota={"limits": [{"window": "day", "unit": "total_tokens",
                                                              "limit": budget}]})],
               "models": [_model([engine])], "admin_keys_sha256": [key_digest("admin")],
               "quotas": {"url": server.url, "key_prefix": "race:", "lease_s": 30}}
        gateways = [start_gateway(bg, cfg) for _ in range(2)]
        cleanups += [g[2] for g in gateways]

        async def flood():
            return await asyncio.gather(*[_stream(gateways[i % 2][0], "team") for i in range(200)])

        answers = asyncio.run(flood())
        codes = [code for code, _, _ in answers]
        assert len(answers) == 200 and set(codes) <= {200, 429}, codes  # every request answered
        assert all(c == ANSWER_TOKENS for code, _, c in answers if code == 200)
        assert {err for code, err, _ in answers if code == 429} == {"quota_exhausted"}
        poll_until(lambda: all(r == 0 for _, r in _levels(server.url, "race:").values()), timeout=20,
                   what="every reservation settled")
        [(spent, reserved)] = _levels(server.url, "race:").values()
        assert codes.count(200) == 50
        assert budget * 0.98 <= spent <= budget, (spent, budget)
        assert all(not g[1].quotas.book.held for g in gateways)  # no reservation kept after its request
        rows = _state(gateways[0][0])["quotas"]["lines"]
        poll_until(lambda: _state(gateways[0][0])["quotas"]["lines"][0]["spent"] == spent, timeout=15,
                   what="the gateway's view of the spend")
        assert rows[0]["owner"] == "team" and rows[0]["limit"] == budget
    finally:
        for cleanup in reversed(cleanups):
            cleanup()
        bg.close()
        server.stop()


def _serve(tmp_path, name: str, cfg: dict) -> tuple[subprocess.Popen, str]:
    port = free_port()
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**cfg, "listen": {"host": "127.0.0.1", "port": port}}))
    proc = subprocess.Popen([sys.executable, "-m", "bouncer", "serve", "--config", str(path)],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.log", "w"))
    base = f"http://127.0.0.1:{port}"
    wait_http_ok(base + "/ready", timeout=30)
    return proc, base


def test_a_gateway_killed_mid_stream_gives_its_reservation_back_within_the_lease(tmp_path):
    server = RedisServer()
    engine = EngineProcess("--speed", "0.5")  # slow: a stream lasts seconds
    procs = []
    try:
        cfg = {"tenants": [_tenant("team", quota={"limits": [{"window": "month", "limit": 1_000_000}]})],
               "models": [_model([engine.url])], "admin_keys_sha256": [key_digest("admin")],
               "quotas": {"url": server.url, "key_prefix": "kill:", "lease_s": 2}}
        victim, victim_url = _serve(tmp_path, "victim", cfg)
        procs.append(victim)
        survivor, survivor_url = _serve(tmp_path, "survivor", cfg)
        procs.append(survivor)

        async def killed_mid_stream():
            client = openai.AsyncOpenAI(base_url=victim_url + "/v1", api_key="team", max_retries=0, timeout=30)
            stream = await client.chat.completions.create(model="demo-llm", messages=PROMPT, max_tokens=2000,
                                                          stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    break  # streaming: its reservation is held
            reserved = sum(r for _, r in _levels(server.url, "kill:").values())
            victim.send_signal(signal.SIGKILL)
            victim.wait(10)
            return reserved

        held = asyncio.run(killed_mid_stream())
        assert held > 0  # its prompt and predicted output (not its max_tokens)
        killed_at = time.monotonic()
        # the survivor's renewals give the dead gateway's reservation back once its lease is out
        poll_until(lambda: sum(r for _, r in _levels(server.url, "kill:").values()) == 0, timeout=10,
                   what="the dead gateway's reservation given back")
        assert time.monotonic() - killed_at <= 2 + 2 / 3 + 1.5  # the lease, a renewal period, the polling
        assert asyncio.run(_stream(survivor_url, "team"))[0] == 200
        poll_until(lambda: next(iter(_levels(server.url, "kill:").values()))[0] > 0, timeout=10,
                   what="the survivor's request settled")
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        engine.stop()
        server.stop()


def test_redis_restarted_from_its_append_only_file_keeps_the_months_spend(tmp_path):
    server = RedisServer(aof_dir=str(tmp_path))
    bg = BackgroundLoop()
    cleanups = []
    try:
        engine, _, stop_engine = start_engine(bg, speed=20.0)
        cleanups.append(stop_engine)
        cfg = {"tenants": [_tenant("team", quota={"limits": [{"window": "month", "limit": 1_000_000}]})],
               "models": [_model([engine])], "quotas": {"url": server.url, "key_prefix": "aof:"}}
        base, _, stop_gateway = start_gateway(bg, cfg)
        cleanups.append(stop_gateway)
        for _ in range(3):
            assert asyncio.run(_stream(base, "team"))[0] == 200
        poll_until(lambda: _levels(server.url, "aof:") and all(r == 0 for _, r in _levels(server.url, "aof:").values()),
                   what="settled")
        before = _levels(server.url, "aof:")
        server.proc.send_signal(signal.SIGKILL)  # no shutdown save: only the append-only file keeps it
        server.proc.wait(10)
        server.start()
        assert _levels(server.url, "aof:") == before and next(iter(before.values()))[0] > 0
        cli = subprocess.run([sys.executable, "-m", "bouncer", "quota", "show", "team", "--json", "--config",
                              str(_write(tmp_path, cfg))], capture_output=True, text=True, timeout=60)
        assert cli.returncode == 0, cli.stderr
        [row] = json.loads(cli.stdout)
        assert row["spent"] == next(iter(before.values()))[0] and row["remaining"] == 1_000_000 - row["spent"]
        reset = subprocess.run([sys.executable, "-m", "bouncer", "quota", "reset", "team", "--config",
                                str(_write(tmp_path, cfg))], capture_output=True, text=True, timeout=60)
        assert reset.returncode == 0 and "spent 0," in reset.stdout, reset.stdout + reset.stderr
    finally:
        for cleanup in reversed(cleanups):
            cleanup()
        bg.close()
        server.stop()


def _write(tmp_path, cfg: dict):
    path = tmp_path / "quota.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("target", ["external", "pool"])
def test_a_saturated_primary_diverts_the_tenant_allowed_to_overflow_and_refuses_the_other(target):
    bg = BackgroundLoop()
    server = RedisServer()  # the diverted tenant has a quota: what the overflow served is counted too
    cleanups = []
    try:
        primary, _, stop_primary = start_engine(bg, speed=2.0)
        spare, spare_server, stop_spare = start_engine(bg, speed=20.0)  # the provider, or a second pool
        cleanups += [stop_primary, stop_spare]
        model = _model([primary])
        models = [model]
        if target == "external":
            model["overflow"] = [{"name": "provider", "url": spare, "api_key_env": "BOUNCER_TEST_PROVIDER_KEY",
                                  "upstream_model": "demo-llm"}]
        else:
            model["overflow"] = [{"name": "provider", "model": "spare-llm"}]
            # the spare pool's replicas are one fast engine listed 8 times (the per-replica cap is the primary's)
            models.append({**_model([spare] * 8), "name": "spare-llm", "upstream_model": "demo-llm"})
        cfg = {"tenants": [_tenant("burst", overflow=True, quota={"limits": [{"window": "month", "limit": 1e9}]}),
                           _tenant("steady")], "models": models, "quotas": {"url": server.url, "key_prefix": "ovf:"},
               "admin_keys_sha256": [key_digest("admin")],
               "policy": {"max_inflight_per_replica": 2, "queues": {"max_requests": 2},
                          "telemetry": {"scrape_interval_s": 0.05}}}
        base, plane, stop_gateway = start_gateway(bg, cfg)
        cleanups.append(stop_gateway)
        poll_until(lambda: bg.call(lambda: all(r.telemetry is not None for r in plane.core.replicas.values())),
                   what="every replica scraped once")

        async def flood():
            return await asyncio.gather(*[_stream(base, ["burst", "steady"][i % 2]) for i in range(32)])

        answers = asyncio.run(flood())
        burst, steady = answers[0::2], answers[1::2]
        assert [code for code, _, _ in burst] == [200] * 16, [a for a in burst if a[0] != 200]  # all served
        assert all(c == ANSWER_TOKENS for _, _, c in burst)
        refused = [(code, err) for code, err, _ in steady if code != 200]
        assert refused and {err for _, err in refused} <= {"queue_full", "saturated", "no_backend"}, refused
        assert all(c == ANSWER_TOKENS for code, _, c in steady if code == 200)
        state = _state(base)
        assert state["inflight"] == 0 and state["queued"] == 0
        stats = plane.core.view.stats
        diverted = sum(n for (outcome, *_, tenant, _b), n in stats.decisions.items()
                       if outcome == "diverted" and tenant == "burst")
        assert diverted >= 1 and not any(o == "diverted" and t == "steady" for (o, _l, _r, t, _b) in stats.decisions)
        # every answer of the diverted tenant counted against its quota, here or at the overflow
        # (each request is the same prompt and 20 tokens: what one cost, from those the primary served)
        served_here = sum(n for (o, _l, _r, _t, _b), n in stats.decisions.items() if o == "completed")
        per_request = sum(stats.served_tokens.values()) / served_here
        poll_until(lambda: all(r == 0 for _, r in _levels(server.url, "ovf:").values()), what="settled")
        [(spent, _)] = _levels(server.url, "ovf:").values()
        assert spent == pytest.approx(16 * per_request) and not plane.quotas.book.held
        if target == "external":
            metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
            assert (f'bouncer_overflow_requests_total{{model="demo-llm",outcome="completed",target="provider"}} '
                    f'{float(diverted)}') in metrics
    finally:
        for cleanup in reversed(cleanups):
            cleanup()
        bg.close()
        server.stop()
