"""`bouncer engine` over real HTTP, driven by the official openai client."""

from __future__ import annotations

import asyncio
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bouncer.tokenizer import PromptTokenizer
from conftest import start_engine
from servers import poll_until


def scrape(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"{{{sample.labels['finished_reason']}}}"
            if "reason" in sample.labels:
                key += f"{{{sample.labels['reason']}}}"
            out[key] = sample.value
    return out


def test_openai_client_non_streaming_chat(engine_server):
    base, server = engine_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Explain continuous batching in one sentence."}]
    resp = client.chat.completions.create(model="demo-llm", messages=messages, max_tokens=12,
                                          extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    # prompt tokens agree with the shared tokenizer and chat template
    assert resp.usage.prompt_tokens == len(PromptTokenizer().encode_chat(messages))
    assert resp.choices[0].message.content


def test_openai_client_streaming_completion_with_usage(engine_server):
    base, _ = engine_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="demo-llm", prompt="def fibonacci(n):", max_tokens=20,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    texts, usage = [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts.append(choice.text)
    assert usage is not None and usage.completion_tokens == 20
    assert len([t for t in texts if t]) == 20


def test_openai_client_streaming_chat(engine_server):
    base, _ = engine_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="demo-llm", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 5
    assert chunks[-1].choices[0].finish_reason == "length"


def test_an_answer_ended_by_eos_finishes_with_stop_and_one_cut_by_max_tokens_with_length(engine_server):
    # as vLLM: "stop" for an end-of-sequence token, "length" for max_tokens, in the answer and
    # in vllm:request_success_total (kv-cache-tester, for one, reads short answers as errors)
    base, _ = engine_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    before = scrape(base)
    short = client.chat.completions.create(model="demo-llm", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=50, extra_body={"eos_after": 7})
    chunks = list(client.chat.completions.create(model="demo-llm", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=50, stream=True, extra_body={"eos_after": 7}))
    cut = client.chat.completions.create(model="demo-llm", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=5, extra_body={"eos_after": 7})
    assert (short.choices[0].finish_reason, short.usage.completion_tokens) == ("stop", 7)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert (cut.choices[0].finish_reason, cut.usage.completion_tokens) == ("length", 5)
    after = scrape(base)
    assert after["vllm:request_success_total{stop}"] - before["vllm:request_success_total{stop}"] == 2
    assert after["vllm:request_success_total{length}"] - before["vllm:request_success_total{length}"] == 1


def test_unknown_model_and_bad_json_get_openai_errors(engine_server):
    base, _ = engine_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    req = urllib.request.Request(base + "/v1/completions", data=b"{not json", method="POST",
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as excinfo:
        urllib.request.urlopen(req, timeout=5)
    assert excinfo.value.code == 400


def test_sampled_output_length_is_capped_by_max_tokens(engine_server):
    base, _ = engine_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    resp = client.completions.create(model="demo-llm", prompt="hello", max_tokens=3)
    assert 1 <= resp.usage.completion_tokens <= 3


def test_metrics_agree_with_engine_state(bg_loop):
    # A tiny pool so requests queue up and get preempted.
    base, server, cleanup = start_engine(bg_loop, speed=20.0, num_blocks=40, max_num_seqs=8)
    try:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        prompt = list(range(100, 300))  # 200 token ids: 13 blocks each

        async def one(i: int):
            return await client.completions.create(model="demo-llm", prompt=[i] + prompt, max_tokens=60,
                                                   extra_body={"ignore_eos": True})

        async def burst():
            return await asyncio.gather(*(one(i) for i in range(10)))

        fut = bg_loop.start_task(burst())
        poll_until(lambda: scrape(base)["vllm:num_requests_waiting"] > 0, what="requests waiting")
        m = scrape(base)
        state = bg_loop.call(lambda: (server.engine.num_running + server.engine.num_waiting))
        assert m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] == pytest.approx(state, abs=2)
        results = fut.result(120)
        assert all(r.usage.completion_tokens == 60 for r in results)
        m = scrape(base)
        c = server.engine.counters
        assert m["vllm:generation_tokens_total"] == c.generation_tokens == 600
        assert m["vllm:prompt_tokens_total"] == c.prompt_tokens == 10 * 201
        assert m["vllm:num_preemptions_total"] == c.num_preemptions > 0
        assert m["vllm:prefix_cache_queries_total"] == c.prefix_cache_queries
        assert m["vllm:request_success_total{length}"] == 10
        assert m["vllm:kv_cache_usage_perc"] == 0.0
        assert m["vllm:time_to_first_token_seconds_count"] == 10
    finally:
        cleanup()


def test_an_engine_run_slower_reports_the_latencies_its_clients_see(bg_loop):
    """At `--speed 0.25` a step takes four times its profile's time on the wall clock, and the
    latency histograms say so, in seconds, as a real engine's do: the step-time learner behind
    Envoy reads decode speed from them."""
    base, _, cleanup = start_engine(bg_loop, speed=0.25, num_blocks=2048, max_num_seqs=8)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        at = []
        for _ in client.completions.create(model="demo-llm", prompt="count to forty", max_tokens=40, stream=True,
                                           extra_body={"ignore_eos": True}):
            at.append(time.monotonic())
        gaps = [b - a for a, b in zip(at[1:-1], at[2:], strict=False)]  # token to token (the last event is [DONE]'s)
        m = scrape(base)
        engine_itl = m["vllm:inter_token_latency_seconds_sum"] / m["vllm:inter_token_latency_seconds_count"]
        assert engine_itl == pytest.approx(sum(gaps) / len(gaps), rel=0.25)
    finally:
        cleanup()


def test_disconnect_aborts_and_frees_kv(bg_loop):
    base, server, cleanup = start_engine(bg_loop, speed=1.0, num_blocks=400, max_num_seqs=8)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            client.completions.create(model="demo-llm", prompt="a long answer please", max_tokens=5000,
                                      extra_body={"ignore_eos": True})
        poll_until(lambda: scrape(base)["vllm:request_success_total{abort}"] == 1, what="abort counted")
        assert scrape(base)["vllm:kv_cache_usage_perc"] == 0.0
        assert bg_loop.call(lambda: server.engine.has_work) is False
    finally:
        cleanup()
