"""Overload end to end: priority traffic keeps its SLO under a flood, and disconnects release
everything they held."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import openai
import pytest

from bouncer.core.outcomes import Terminal
from gateway_setup import Fleet, tenant
from servers import poll_until

FLOOD_PROMPT = "lorem ipsum dolor sit amet " * 300  # 4,201 tokens
MEDIUM_PROMPT = "lorem ipsum dolor sit amet " * 100  # ~1,400 tokens


async def _ttft(base_url: str, key: str) -> float:
    c = openai.AsyncOpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)
    t0 = time.monotonic()
    stream = await c.chat.completions.create(model="demo-llm", messages=[{"role": "user", "content": "quick one"}],
                                             max_tokens=8, stream=True, extra_body={"ignore_eos": True})
    ttft = None
    async for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.monotonic() - t0
    return ttft


async def _flood_then_probe(base_url: str, flood_key: str, probe_key: str, n_flood: int = 150,
                            probes: int = 8, while_flooding=None) -> tuple[list[float], object]:
    """Start `n_flood` long requests at once, then measure the TTFT of `probes` short priority
    requests while the flood is on; `while_flooding()` is read just before the flood is
    cancelled at the end (bounded)."""
    flood_client = openai.AsyncOpenAI(base_url=base_url, api_key=flood_key, max_retries=2, timeout=60)

    async def flood_one():
        try:
            await flood_client.completions.create(model="demo-llm", prompt=FLOOD_PROMPT, max_tokens=200,
                                                  extra_body={"ignore_eos": True})
        except openai.APIError:
            pass

    flood = [asyncio.create_task(flood_one()) for _ in range(n_flood)]
    await asyncio.sleep(1.0)  # let it pile up
    ttfts = []
    for _ in range(probes):
        ttfts.append(await _ttft(base_url, probe_key))
        await asyncio.sleep(0.2)
    seen = while_flooding() if while_flooding else None
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    return ttfts, seen


@pytest.mark.slow
def test_free_tier_flood_leaves_interactive_within_its_ttft_slo(bg_loop):
    f = Fleet(bg_loop, [tenant("demo-interactive", priority=10, slo={"ttft_s": 1.0}, kv_share=0.25),
                        tenant("demo-free", priority=-1)],
              engines=2, engine_kwargs={"num_blocks": 1024, "max_num_seqs": 64},
              policy={"band_ceilings": {10: 1.25}})
    try:
        core = f.gateway.core

        def flood_state():  # read in the gateway's loop, before the flood's clients give up
            decisions = dict(core.stats.decisions)
            pushed_back = sum(n for k, n in decisions.items() if k[3] == "demo-free" and k[0] in ("refused", "evicted"))
            return core.view.queued, pushed_back, sorted(decisions.items())

        ttfts, (queued, pushed_back, decisions) = bg_loop.start_task(_flood_then_probe(
            f.url + "/v1", "demo-free", "demo-interactive", while_flooding=flood_state)).result(120)
        assert max(ttfts) < 1.0, ttfts
        # the flood was held back: still queued at the gateway when it gave up, or refused or evicted
        # (once its clients go, the permits they free may pass to queued requests whose clients
        # are going too: what the counts say after that is not what the flood met)
        assert queued + pushed_back > 0, decisions
        slo = f.call(lambda: (f.gateway.core.stats.slo_met["demo-interactive"],
                              f.gateway.core.stats.slo_total["demo-interactive"]))
        assert slo[0] == slo[1] == 8
        # the flood's cancelled requests left nothing behind
        poll_until(lambda: f.call(lambda: f.gateway.core.view.inflight + f.gateway.core.view.queued) == 0,
                   what="permits released")
        # Contrast, same flood straight at an engine: the probe waits behind it (FCFS).
        direct_url = f.engines[0][0] + "/v1"
        direct, _ = bg_loop.start_task(_flood_then_probe(direct_url, "x", "x", n_flood=75, probes=1)).result(120)
        assert direct[0] > 1.0, direct
    finally:
        f.close()


def test_disconnect_while_queued_leaves_the_queue(bg_loop):
    # one replica with room for about one request: the rest queue at the gateway
    f = Fleet(bg_loop, [tenant("alice")], engines=1, engine_kwargs={"num_blocks": 200, "max_num_seqs": 8},
              policy={"saturation": {"kv_threshold": 1.0}, "kv_busy_threshold": 0.9})
    try:
        client = openai.AsyncOpenAI(base_url=f.url + "/v1", api_key="alice", max_retries=0)

        async def long_one():
            return await client.completions.create(model="demo-llm", prompt=MEDIUM_PROMPT, max_tokens=300,
                                                   extra_body={"ignore_eos": True})

        holder = bg_loop.start_task(long_one())
        poll_until(lambda: f.call(lambda: f.gateway.core.view.inflight) == 1, what="first request running")
        impatient = openai.OpenAI(base_url=f.url + "/v1", api_key="alice", max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="demo-llm", prompt=MEDIUM_PROMPT, max_tokens=300)
        poll_until(lambda: f.call(lambda: f.gateway.core.stats.outcomes[Terminal.CANCELLED]) == 1,
                   what="queued request cancelled")
        assert f.call(lambda: f.gateway.core.view.queued) == 0
        holder.cancel()
        poll_until(lambda: f.call(lambda: f.gateway.core.view.inflight) == 0, what="permit released")
    finally:
        f.close()


def test_disconnect_mid_stream_cancels_upstream_and_releases_permit(bg_loop):
    f = Fleet(bg_loop, [tenant("alice")], engines=1, engine_kwargs={"num_blocks": 2048, "max_num_seqs": 8})
    try:
        async def read_two_chunks_then_leave():
            async with aiohttp.ClientSession() as s:
                body = {"model": "demo-llm", "prompt": "tell me a long story", "max_tokens": 2000, "stream": True,
                        "ignore_eos": True}
                async with s.post(f.url + "/v1/completions", json=body,
                                  headers={"Authorization": "Bearer alice"}) as resp:
                    assert resp.status == 200
                    seen = 0
                    async for line in resp.content:
                        if line.startswith(b"data: {"):
                            seen += 1
                            if seen == 2:
                                break  # leaving the context closes the connection

        bg_loop.start_task(read_two_chunks_then_leave()).result(30)
        engine = f.engines[0][1].engine
        poll_until(lambda: f.call(lambda: engine.counters.request_success["abort"]) == 1, what="upstream aborted")
        poll_until(lambda: f.call(lambda: f.gateway.core.view.inflight) == 0, what="permit released")
        assert f.call(lambda: engine.has_work) is False and f.call(lambda: engine.kv_usage) == 0.0
        assert f.call(lambda: f.gateway.core.stats.outcomes[Terminal.CANCELLED]) == 1
    finally:
        f.close()
