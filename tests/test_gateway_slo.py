"""SLO feasibility through the gateway: the official openai client, Bouncer with the engines'
step-time model, and `bouncer engine` servers."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import openai
import pytest

from bouncer.sim.profiles import DEFAULT_PROFILE, get_profile
from gateway_setup import Fleet, tenant

SPEED = 4.0  # the engines run 4x faster than their profile: so does the step-time model stated here


@pytest.fixture
def fleet(bg_loop):
    step = {k: (v / SPEED if k in "abc" else v) for k, v in get_profile(DEFAULT_PROFILE).step_time_config.items()}
    f = Fleet(bg_loop, [tenant("alice", slo={"ttft_s": 2.0, "tpot_s": 0.5})], engines=1,
              engine_kwargs={"num_blocks": 2048, "max_num_seqs": 32}, speed=SPEED, model={"step_time": step})
    yield f
    f.close()


def test_a_deadline_no_replica_can_meet_is_refused_before_prefill_with_retry_after(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
    with pytest.raises(openai.RateLimitError) as err:
        # one engine step alone takes longer than this request's own 1 ms TTFT SLO
        client.completions.create(model="demo-llm", prompt="hello", max_tokens=4,
                                  extra_headers={"x-bouncer-ttft-ms": "1"})
    resp = err.value.response
    assert resp.status_code == 429
    assert resp.json()["error"]["code"] == "deadline_infeasible"
    assert "retry-after" in resp.headers or "retry-after-ms" in resp.headers
    engine = fleet.engines[0][1]
    assert fleet.call(lambda: engine.engine.counters.prompt_tokens) == 0  # no prefill was spent on it


def test_served_requests_correct_the_replica_predictor_and_show_in_metrics(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
    for _ in range(5):
        stream = client.completions.create(model="demo-llm", prompt="tell me about admission control",
                                           max_tokens=16, stream=True, extra_body={"ignore_eos": True})
        assert sum(1 for c in stream if c.choices and c.choices[0].text) == 16
    latency = fleet.call(lambda: fleet.gateway.core.replicas["e0"].latency)
    # the engine's real step times plus HTTP and event-loop delays: the factors moved off 1.0
    assert fleet.call(lambda: (latency.ttft_factor, latency.tpot_factor)) != (1.0, 1.0)
    text = urllib.request.urlopen(fleet.url + "/metrics", timeout=5).read().decode()
    assert 'bouncer_replica_latency_correction{kind="ttft",replica="e0"}' in text


def test_short_answers_slowed_by_long_prefill_steps_cut_the_prefill_a_replica_takes(bg_loop):
    # A TPOT SLO of 20 ms: one step of a 4,000-token prompt takes about 28 ms on this engine (the
    # default profile at SPEED), so a 3-token answer decoding beside one misses it.
    step = {k: (v / SPEED if k in "abc" else v) for k, v in get_profile(DEFAULT_PROFILE).step_time_config.items()}
    fleet = Fleet(bg_loop, [tenant("alice", slo={"ttft_s": 10.0, "tpot_s": 0.02})], engines=1,
                  engine_kwargs={"num_blocks": 4096, "max_num_seqs": 32}, speed=SPEED, model={"step_time": step})
    try:
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
        long_prompt = "admission " * 1000  # 4,001 tokens
        r = fleet.call(lambda: fleet.gateway.core.replicas["e0"])

        async def long_prompts():  # two at a time until the limit is cut, for at most 30 s
            c = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
            end = time.monotonic() + 30
            n = 0
            while r.prefill_limit == float("inf") and time.monotonic() < end:
                n += 2  # each its own first words, so that none is in the engine's prefix cache
                await asyncio.gather(*(c.completions.create(model="demo-llm", prompt=f"{i} {long_prompt}", max_tokens=1)
                                       for i in (n, n + 1)))

        flood = fleet.bg_loop.start_task(long_prompts())
        while not flood.done():  # short answers beside them
            stream = client.completions.create(model="demo-llm", prompt="short", max_tokens=3, stream=True,
                                               extra_body={"ignore_eos": True})
            assert sum(1 for c in stream if c.choices and c.choices[0].text) == 3
        flood.result(60)
        req = urllib.request.Request(fleet.url + "/admin/state", headers={"Authorization": "Bearer admin"})
        state = json.loads(urllib.request.urlopen(req, timeout=5).read())
        limits = state["models"]["demo-llm"]["replicas"]["e0"]["limits"]
        # cut to what one step may batch within 20 ms by the stated model (under 3,000 tokens),
        # and no lower than the floor; short answers leave the in-flight limit alone
        assert limits["prefill_tokens"] is not None and 1024 <= limits["prefill_tokens"] < 3000, limits
        assert limits["inflight"] is None, limits
    finally:
        fleet.close()
