"""Bouncer under load generators it did not write, and under faults: guidellm floods it at 3x,
and a chaos run disconnects clients at random points while engine processes are frozen and
killed. Afterwards, every time: nothing in flight or queued, and the top tenant served at once."""

from __future__ import annotations

import asyncio
import os
import pathlib
import random
import signal
import time
import urllib.request

import aiohttp
import openai
import pytest

from bouncer.bench import guidellm
from conftest import start_gateway
from gateway_setup import tenant
from servers import BackgroundLoop, EngineProcess, poll_until, stop_all

REPO = pathlib.Path(__file__).resolve().parents[1]
# a relative path in the environment is from the repository
GUIDELLM = REPO / os.environ.get("BOUNCER_GUIDELLM", ".venv-guidellm/bin/guidellm")


def _gateway(bg_loop, engines: list[EngineProcess], **policy):
    return start_gateway(bg_loop, {
        "admin_keys_sha256": [],
        "tenants": [tenant("top", priority=10, slo={"ttft_s": 1.0}), tenant("flood", priority=-1),
                    tenant("std", priority=0)],
        "models": [{"name": "demo-llm", "max_model_len": 8192,
                    "backends": [{"url": e.url, "name": f"e{i}"} for i, e in enumerate(engines)]}],
        "policy": {"telemetry": {"scrape_interval_s": 0.1, "staleness_s": 1.0}, **policy},
    })


def _top_ttft(base: str) -> float:
    client = openai.OpenAI(base_url=base + "/v1", api_key="top", max_retries=0, timeout=30)
    t0 = time.monotonic()
    for chunk in client.completions.create(model="demo-llm", prompt="quick one", max_tokens=4, stream=True,
                                           extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].text:
            return time.monotonic() - t0
    raise AssertionError("no token")


@pytest.mark.slow
@pytest.mark.skipif(not GUIDELLM.exists(), reason=f"no guidellm at {GUIDELLM}: `make test` installs it")
def test_guidellm_at_3x_overload_then_idle_leaves_nothing_in_flight(tmp_path):
    bg_loop = BackgroundLoop()
    engine = EngineProcess("--kv-blocks", "2048", "--max-num-seqs", "64", "--speed", "0.25")
    base, gw, cleanup = _gateway(bg_loop, [engine])
    try:
        # this engine completes about 8 of these requests per second (512 in, 64 out, at 0.25x):
        # 24 req/s is 3x its capacity, for 30 s
        run = guidellm.run(GUIDELLM, base, "demo-llm", "flood", rate=24, seconds=30, prompt_tokens=512,
                           output_tokens=64, workdir=tmp_path / "guidellm")
        assert run.total > 500 and run.successful > 0
        assert run.errored > 0.2 * run.total  # overload: the flood was pushed back
        core = gw.core
        poll_until(lambda: bg_loop.call(lambda: core.view.inflight + core.view.queued) == 0, timeout=15,
                   what="in-flight and queued back at 0 after guidellm")
        assert engine.running() == 0
        stats = bg_loop.call(lambda: core.stats)
        assert stats.reclaimed == 0 and sum(stats.outcomes.values()) == stats.offered
        assert _top_ttft(base) < 1.0  # served at once on the idle fleet
    finally:
        stop_all(bg_loop, cleanup, engine.stop)


async def _chaos_client(base: str, rng: random.Random, statuses: list[int], key: str) -> None:
    """One request that may leave at a random point: while queued, right after the headers, or
    mid-stream; or stay to the end."""
    body = {"model": "demo-llm", "prompt": "chaos " * rng.randint(10, 400), "max_tokens": rng.randint(4, 64),
            "stream": rng.random() < 0.7, "ignore_eos": True}
    leave_after = rng.choice([None, None, 0.0, 0.05, 0.3, 1.0])
    async with aiohttp.ClientSession() as s:
        try:
            async with asyncio.timeout(leave_after if leave_after is not None else 30):
                async with s.post(base + "/v1/completions", json=body,
                                  headers={"Authorization": f"Bearer {key}"}) as resp:
                    statuses.append(resp.status)
                    if resp.status != 200:
                        assert resp.content_type == "application/json", (resp.status, await resp.text())
                        assert (await resp.json())["error"]["message"]
                    async for _ in resp.content:
                        pass
        except TimeoutError:
            pass  # the client left
        except aiohttp.ClientError:
            pass


@pytest.mark.slow
def test_chaos_random_disconnects_frozen_and_killed_engines_leave_no_permit_and_no_500():
    bg_loop = BackgroundLoop()
    engines = [EngineProcess("--kv-blocks", "1024", "--max-num-seqs", "32", "--speed", "2") for _ in range(2)]
    base, gw, cleanup = _gateway(bg_loop, engines)
    rng = random.Random(7)
    statuses: list[int] = []

    async def load(seconds: float) -> None:
        tasks = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            key = rng.choice(["flood", "flood", "std", "top"])
            tasks.append(asyncio.create_task(_chaos_client(base, rng, statuses, key)))
            await asyncio.sleep(rng.expovariate(40))
        await asyncio.gather(*tasks)

    try:
        running = bg_loop.start_task(load(12))
        time.sleep(2)
        engines[1].signal(signal.SIGSTOP)  # frozen: answers nothing, scrapes time out
        time.sleep(3)
        engines[1].signal(signal.SIGCONT)
        time.sleep(2)
        engines[0].proc.kill()  # killed mid-stream, and started again
        engines[0].proc.wait(10)
        time.sleep(1)
        engines[0].start()
        running.result(120)
        assert len(statuses) > 200 and 500 not in statuses, sorted(set(statuses))
        core = gw.core
        poll_until(lambda: bg_loop.call(lambda: core.view.inflight + core.view.queued) == 0, timeout=60,
                   what="in-flight and queued back at 0 after the chaos")
        poll_until(lambda: all(e.running() == 0 for e in engines), timeout=30, what="engines idle")
        stats = bg_loop.call(lambda: core.stats)
        assert sum(stats.outcomes.values()) == stats.offered and stats.reclaimed == 0
        poll_until(lambda: urllib.request.urlopen(base + "/ready", timeout=5).status == 200, timeout=20,
                   what="ready again")
        assert _top_ttft(base) < 1.0
    finally:
        stop_all(bg_loop, cleanup, *(e.stop for e in engines))
