"""A disaggregated fleet end to end: the gateway in front of a prefill and a decode `bouncer
engine` (real processes, speaking vLLM's P/D protocol), driven by the openai SDK."""

from __future__ import annotations

import urllib.request

import openai
import pytest

from bouncer.tokenizer import default_tokenizer_path
from conftest import start_gateway
from gateway_setup import tenant
from servers import EngineProcess, poll_until


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return sum(float(line.split()[-1]) for line in resp.read().decode().splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))


def _pd_gateway(bg_loop, prefill: EngineProcess, decode: EngineProcess):
    config = {
        "tenants": [tenant("alice", slo={"ttft_s": 10.0})],
        "models": [{"name": "demo-llm", "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                    "backends": [{"url": prefill.url, "name": "p0", "role": "prefill"},
                                 {"url": decode.url, "name": "d0", "role": "decode"}]}],
        "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 1.0}},
    }
    base, gw, cleanup = start_gateway(bg_loop, config)
    poll_until(lambda: bg_loop.call(lambda: all(r.telemetry for r in gw.core.replicas.values())), what="scraped")
    return base, gw, cleanup


@pytest.fixture
def pd_engines():
    engines = [EngineProcess("--model", "demo-llm", "--kv-connector", "--speed", "4") for _ in range(2)]
    yield engines
    for e in engines:
        e.stop()


def test_the_prefill_worker_computes_the_prompt_and_the_decode_worker_answers(bg_loop, pd_engines):
    prefill, decode = pd_engines
    base, gw, cleanup = _pd_gateway(bg_loop, prefill, decode)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="alice", max_retries=0, timeout=30)
        tokens = 0
        for i in range(3):
            chat = client.chat.completions.create(model="demo-llm", max_tokens=20,
                                                  messages=[{"role": "user", "content": f"question {i} " * 50}],
                                                  extra_body={"ignore_eos": True})
            assert chat.choices[0].message.content and chat.usage.completion_tokens == 20
            tokens += chat.usage.completion_tokens
        stream = client.completions.create(model="demo-llm", prompt="a long document " * 100, max_tokens=12,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 12
        tokens += 12
        # each prefill produced one token, discarded; the decode worker generated every answer
        assert _counter(prefill.url, "vllm:generation_tokens_total") == 4
        assert _counter(decode.url, "vllm:generation_tokens_total") == tokens
        assert _counter(decode.url, "vllm:request_success_total") == 4

        def settled() -> bool:
            d0 = gw.core.replicas["d0"]
            return not gw.core.permits and not d0.inflight and len(d0.decode_ledger) == 0
        poll_until(lambda: bg_loop.call(settled), what="permits and the decode ledger released")
    finally:
        cleanup()


def test_a_prefill_worker_without_a_kv_connector_gets_a_clear_error_not_a_500(bg_loop):
    prefill, decode = EngineProcess("--model", "demo-llm"), EngineProcess("--model", "demo-llm", "--kv-connector")
    base, gw, cleanup = _pd_gateway(bg_loop, prefill, decode)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="alice", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="demo-llm", prompt="hello", max_tokens=5)
        assert err.value.status_code == 502
        assert "kv_transfer_params" in str(err.value.body)
        assert _counter(decode.url, "vllm:generation_tokens_total") == 0
        poll_until(lambda: bg_loop.call(lambda: not gw.core.permits), what="permit released")
    finally:
        cleanup()
        prefill.stop()
        decode.stop()


def test_engine_speaks_vllms_kv_transfer_params(pd_engines):
    import json
    prefill, decode = pd_engines

    def post(url: str, body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    prompt = list(range(1, 101))  # 100 token ids: 7 blocks of 16
    status, answer = post(prefill.url, {"model": "demo-llm", "prompt": prompt, "max_tokens": 50,
                                        "kv_transfer_params": {"do_remote_decode": True}})
    assert status == 200 and answer["usage"]["completion_tokens"] == 1
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == prefill.url[len("http://"):]
    assert len(params["remote_block_ids"]) == 7
    status, answer = post(decode.url, {"model": "demo-llm", "prompt": prompt, "max_tokens": 5, "ignore_eos": True,
                                       "kv_transfer_params": params})
    assert status == 200 and answer["usage"]["completion_tokens"] == 5
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 99  # taken as computed, but the last
    status, answer = post(decode.url, {"model": "demo-llm", "prompt": prompt[:20], "max_tokens": 5,
                                       "kv_transfer_params": params})
    assert status == 400 and "remote_block_ids" in answer["error"]["message"]
