"""Late scrapes are not dead engines (issue 23): freshness counts from when a scrape's answer
came, a replica streaming tokens to our requests is answering though its scrape is late or
timed out, and fail-closed refuses only when an engine really stops answering. Live: a process
burning a core beside the gateway and a slow engine, and no `no_backend` refusal."""

from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
from collections import Counter

import aiohttp
import pytest
from aiohttp import web

from bouncer.bench import guidellm
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.outcomes import Terminal
from conftest import start_gateway
from core_helpers import dispatched, info, make_core, rejected, tenant
from gateway_setup import tenant as gw_tenant
from servers import BackgroundLoop, EngineProcess, free_port, stop_all

REPO = pathlib.Path(__file__).resolve().parents[1]
# a relative path in the environment is from the repository
GUIDELLM = REPO / os.environ.get("BOUNCER_GUIDELLM", ".venv-guidellm/bin/guidellm")
POLICY = {"telemetry": {"staleness_s": 2.0, "on_stale": "fail-closed"}}


def _replica(core):
    return core.view.replica_names()[0]


def test_a_scrape_that_answered_late_is_fresh_from_when_it_answered():
    core = make_core(replicas=1, policy=POLICY, tenants=[tenant("a")], fresh=False)
    # the scrape started at t=0 and its answer came at t=2.5 (a busy engine, a busy machine)
    core.observe(_replica(core), Telemetry(at=0.0, kv_usage=0.1, running=0, waiting=0, received=2.5), 2.5)
    assert dispatched(core.offer(info("a"), 4.0))  # 4 s after it was asked, 1.5 s after it answered


def test_a_replica_streaming_our_tokens_is_answering_though_its_scrape_is_late():
    core = make_core(replicas=1, policy=POLICY, tenants=[tenant("a")], fresh=False)
    name = _replica(core)
    core.observe(name, Telemetry(at=0.0, kv_usage=0.1, running=0, waiting=0), 0.0)
    (d,) = dispatched(core.offer(info("a"), 0.5))
    core.started(d.request_id, 3.0)  # tokens come; the scrapes do not
    core.observe(name, None, 3.5)  # and one times out
    (d2,) = dispatched(core.offer(info("a"), 4.0))
    assert d2.replica == name
    core.finished(d.request_id, 4.5, Terminal.COMPLETED, 10)
    core.finished(d2.request_id, 4.6, Terminal.COMPLETED, 10)
    # nothing streamed for the staleness window and no scrape answered: it has stopped answering
    (r,) = rejected(core.offer(info("a"), 7.0))
    assert r.refusal.reason == "no_backend"


def test_without_streams_counting_a_stale_replica_is_shut_out_as_before():
    core = make_core(replicas=1, tenants=[tenant("a")], fresh=False,
                     policy={"telemetry": {**POLICY["telemetry"], "alive_from_streams": False}})
    name = _replica(core)
    core.observe(name, Telemetry(at=0.0, kv_usage=0.1, running=0, waiting=0), 0.0)
    (d,) = dispatched(core.offer(info("a"), 0.5))
    core.started(d.request_id, 3.0)
    (r,) = rejected(core.offer(info("a"), 3.0))
    assert r.refusal.reason == "no_backend"


class SlowMetricsProxy:
    """In front of a real engine: /metrics answers `delay_s` late (an engine too busy to answer
    its scrapes promptly), everything else passes through as it streams."""

    def __init__(self, bg_loop: BackgroundLoop, upstream: str, delay_s: float) -> None:
        self.upstream, self.delay_s = upstream, delay_s
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.bg_loop = bg_loop
        self.runner = bg_loop.run(self._start())

    async def _start(self) -> web.AppRunner:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._relay)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        return runner

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/metrics":
            await asyncio.sleep(self.delay_s)
        async with self.session.request(request.method, self.upstream + request.path_qs, data=await request.read(),
                                        headers={"Content-Type": request.content_type}) as up:
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
            await resp.prepare(request)
            try:
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
                await resp.write_eof()
            except ConnectionResetError:  # the gateway left (its client did): so does the engine's stream
                pass
            return resp

    def close(self) -> None:
        async def stop():
            await self.runner.cleanup()
            await self.session.close()
        self.bg_loop.run(stop())


@pytest.mark.slow
@pytest.mark.skipif(not GUIDELLM.exists(), reason=f"no guidellm at {GUIDELLM}: `make test` installs it")
def test_with_scrapes_answering_late_and_a_core_burnt_no_request_is_refused_for_no_backend(tmp_path):
    """One tenant through one 0.25x engine at 2x (guidellm, 20 s) while another process spins on
    a core, and the engine's /metrics answers 0.9 s late, within the 1 s staleness: the engine
    answers throughout, so nothing may be refused as if there were no backend. (Before, a
    scrape counted as old as when it was asked: each arrived 0.9 s old and was stale 0.1 s
    later, and fail-closed refused nearly everything.)"""
    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 90\nwhile time.time() < end: pass"])
    bg_loop = BackgroundLoop()
    engine = EngineProcess("--kv-blocks", "2048", "--max-num-seqs", "64", "--speed", "0.25")
    proxy = SlowMetricsProxy(bg_loop, engine.url, delay_s=0.9)
    base, gw, cleanup = start_gateway(bg_loop, {
        "admin_keys_sha256": [],
        "tenants": [gw_tenant("solo", slo={"ttft_s": 2.0})],
        "models": [{"name": "demo-llm", "max_model_len": 8192, "backends": [{"url": proxy.url, "name": "e0"}]}],
        "policy": {"telemetry": {"scrape_interval_s": 0.25, "staleness_s": 1.0, "on_stale": "fail-closed"}},
    })
    try:
        run = guidellm.run(GUIDELLM, base, "demo-llm", "solo", rate=16, seconds=20, prompt_tokens=512,
                           output_tokens=64, workdir=tmp_path / "guidellm")
        stats = bg_loop.call(lambda: gw.core.stats)
        ends = Counter()
        for (outcome, _, reason, _, _), n in stats.decisions.items():
            ends[f"{outcome}/{reason}"] += n
        assert run.successful > 100
        assert not any(key.endswith("/no_backend") for key in ends), ends
    finally:
        try:
            stop_all(bg_loop, cleanup, proxy.close, engine.stop)
        finally:
            hog.kill()
