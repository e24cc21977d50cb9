"""The gateway end to end: the official openai client, through Bouncer, to `bouncer engine`."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import openai
import pytest

from bouncer.core.agents.gate import session_key
from gateway_setup import Fleet, tenant
from servers import poll_until


@pytest.fixture
def fleet(bg_loop):
    f = Fleet(bg_loop, [tenant("alice", priority=1, slo={"ttft_s": 2.0}),
                        tenant("limited", rate_limit={"requests_per_s": 1, "request_burst": 1})],
              engines=2, engine_kwargs={"num_blocks": 2048, "max_num_seqs": 32}, speed=4.0)
    yield f
    f.close()


def post(url: str, body: bytes, key: str | None = "alice", headers: dict | None = None):
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=body, headers=h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def test_openai_client_non_streaming_and_streaming(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
    resp = client.chat.completions.create(model="demo-llm", messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=8, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 8 and resp.choices[0].message.content
    stream = client.chat.completions.create(model="demo-llm", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=6, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) == 6
    assert all(c.usage is None for c in chunks)  # the client did not ask for usage: not forwarded
    stream = client.completions.create(model="demo-llm", prompt="x = 1", max_tokens=5, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage and usage[-1].completion_tokens == 5
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo-llm"]
    stats = fleet.call(lambda: fleet.gateway.core.stats)
    assert stats.outcomes["completed"] == 3
    assert stats.slo_total["alice"] == 3


def test_openai_client_retries_honour_retry_after(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="limited", max_retries=3)
    client.completions.create(model="demo-llm", prompt="a", max_tokens=1)
    t0 = time.monotonic()
    resp = client.completions.create(model="demo-llm", prompt="b", max_tokens=1)  # 429, Retry-After: 1, retried
    elapsed = time.monotonic() - t0
    assert resp.usage.completion_tokens == 1
    assert elapsed >= 0.9  # it waited for the Retry-After we sent
    decisions = fleet.call(lambda: dict(fleet.gateway.core.stats.decisions))
    assert sum(n for k, n in decisions.items() if k[2] == "rate_limited_requests") >= 1


@pytest.mark.parametrize("body,key,status,reason", [
    (b"{not json", "alice", 400, "invalid_request"),
    (b"[1, 2]", "alice", 400, "invalid_request"),
    (json.dumps({"model": "demo-llm", "prompt": "x"}).encode(), "nobody", 401, "unauthenticated"),
    (json.dumps({"model": "demo-llm", "prompt": "x"}).encode(), None, 401, "unauthenticated"),
    (json.dumps({"model": "gpt-7", "prompt": "x"}).encode(), "alice", 404, "model_not_found"),
    (json.dumps({"model": "demo-llm", "prompt": "x", "n": 5}).encode(), "alice", 400, "invalid_parameter"),
    (json.dumps({"model": "demo-llm", "prompt": "x", "max_tokens": -1}).encode(), "alice", 400, "invalid_parameter"),
    (json.dumps({"model": "demo-llm", "prompt": "x", "max_tokens": "ten"}).encode(), "alice", 400,
     "invalid_parameter"),
    (json.dumps({"model": "demo-llm", "prompt": {"a": 1}}).encode(), "alice", 400, "invalid_parameter"),
    (json.dumps({"model": "demo-llm", "prompt": "x", "stop": ["a"] * 9}).encode(), "alice", 400,
     "invalid_parameter"),
    (json.dumps({"model": "demo-llm", "prompt": "x" * 100000, "max_tokens": 10}).encode(), "alice", 400,
     "context_length_exceeded"),
])
def test_bad_requests_get_the_right_status_and_an_openai_error(fleet, body, key, status, reason):
    code, headers, raw = post(fleet.url + "/v1/completions", body, key)
    assert code == status
    err = json.loads(raw)["error"]
    assert err["reason"] == reason and err["message"] and err["type"]
    assert "Retry-After" not in headers


def test_huge_body_is_413(fleet):
    limit = fleet.config.get("limits", {}).get("max_body_bytes", 4 * 1024 * 1024)
    body = json.dumps({"model": "demo-llm", "prompt": "y" * (limit + 10)}).encode()
    code, _, raw = post(fleet.url + "/v1/completions", body)
    assert code == 413 and json.loads(raw)["error"]["reason"] == "body_too_large"


def test_admin_endpoints_need_the_admin_key_and_drain_works(fleet):
    code, _, _ = post(fleet.url + "/admin/drain?model=demo-llm", b"", key="alice")
    assert code == 401
    code, _, raw = post(fleet.url + "/admin/drain?model=demo-llm", b"", key="admin")
    assert code == 200 and json.loads(raw)["draining"] is True
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0, timeout=30)
    results = []

    async def queued_call():
        c = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
        results.append(await c.completions.create(model="demo-llm", prompt="q", max_tokens=2))

    fut = fleet.bg_loop.start_task(queued_call())
    poll_until(lambda: fleet.call(lambda: fleet.gateway.core.view.queued) == 1, what="held while draining")
    code, _, _ = post(fleet.url + "/admin/undrain", json.dumps({"model": "demo-llm"}).encode(), key="admin")
    assert code == 200
    fut.result(30)
    assert results[0].usage.completion_tokens >= 1
    req = urllib.request.Request(fleet.url + "/admin/state", headers={"Authorization": "Bearer admin"})
    state = json.loads(urllib.request.urlopen(req, timeout=5).read())
    assert set(state["models"]["demo-llm"]["replicas"]) == {"e0", "e1"}
    del client


def test_reload_applies_new_config_without_dropping_inflight(fleet):
    async def long_stream():
        c = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
        s = await c.completions.create(model="demo-llm", prompt="a long one", max_tokens=200, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        return [x.usage.completion_tokens async for x in s if x.usage][-1]

    running = fleet.bg_loop.start_task(long_stream())
    poll_until(lambda: fleet.call(lambda: fleet.gateway.core.view.inflight) == 1, what="stream in flight")
    new = json.loads(json.dumps(fleet.config))
    new["tenants"].append(tenant("carol"))
    code, _, raw = post(fleet.url + "/admin/reload", json.dumps(new).encode(), key="admin")
    assert running.result(60) == 200  # the stream in flight during the reload completed whole
    assert fleet.call(lambda: fleet.gateway.core.stats.outcomes["completed"]) == 1
    assert code == 200 and "carol" in json.loads(raw)["tenants"]
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="carol", max_retries=0)
    assert client.completions.create(model="demo-llm", prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    bad = {**new, "tenants": [{"name": "x"}]}
    code, _, raw = post(fleet.url + "/admin/reload", json.dumps(bad).encode(), key="admin")
    assert code == 400 and "api_keys_sha256" in json.loads(raw)["error"]["message"]


def test_metrics_endpoint_reports_decisions_and_goodput(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
    client.completions.create(model="demo-llm", prompt="hi", max_tokens=3)
    post(fleet.url + "/v1/completions", b"{bad", "alice")
    text = urllib.request.urlopen(fleet.url + "/metrics", timeout=5).read().decode()
    assert 'bouncer_decisions_total{band="1",layer="-",outcome="admitted",reason="-",tenant="alice"} 1.0' in text
    assert 'outcome="refused",reason="invalid_request"' in text
    assert 'bouncer_slo_attainment_ratio{tenant="alice"} 1.0' in text
    assert "bouncer_replica_telemetry_age_seconds" in text and "bouncer_queue_wait_seconds_bucket" in text
    ready = urllib.request.urlopen(fleet.url + "/ready", timeout=5)
    assert ready.status == 200


def test_x_session_id_makes_a_request_a_step_of_an_agent(fleet):
    client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
    for _ in range(2):
        client.completions.create(model="demo-llm", prompt="plan the next tool call", max_tokens=3,
                                  extra_headers={"x-session-id": "agent-42"}, user="someone")
    client.completions.create(model="demo-llm", prompt="a chat", max_tokens=3, user="someone-else")
    window = fleet.call(lambda: fleet.gateway.core.models["demo-llm"].agents.window)
    agent = session_key("alice", "agent-42")  # the window knows an agent by its tenant and its id
    assert fleet.call(lambda: list(window.active)) == [agent]  # `user` alone is not a session
    text = urllib.request.urlopen(fleet.url + "/metrics", timeout=5).read().decode()
    assert 'bouncer_active_agents{model="demo-llm"} 1.0' in text and "bouncer_agent_window" in text
    # a subagent names its parent: it runs in the parent's slot, not in one of its own
    client.completions.create(model="demo-llm", prompt="explore the repository", max_tokens=3,
                              extra_headers={"x-session-id": "agent-42/explore", "x-parent-session-id": "agent-42"})
    explore = session_key("alice", "agent-42/explore")
    assert fleet.call(lambda: (window.holders(), window.active[explore].parent)) == (1, agent)
    text = urllib.request.urlopen(fleet.url + "/metrics", timeout=5).read().decode()
    assert 'bouncer_active_agents{model="demo-llm"} 1.0' in text
    assert 'bouncer_active_subagents{model="demo-llm"} 1.0' in text


def test_upstream_refusals_are_held_not_passed_on_including_streaming_200_with_error(bg_loop):
    # An engine that refuses beyond 1 queued request (vLLM's --max-num-queued-reqs: 503, and for
    # streams HTTP 200 with an error event). Bouncer over-sends (it does not know that cap), sees
    # the refusal, and holds the request again instead of passing the 503 on.
    f = Fleet(bg_loop, [tenant("alice")], engines=1, speed=4.0,
              engine_kwargs={"num_blocks": 2048, "max_num_seqs": 8, "max_num_queued_reqs": 1},
              policy={"upstream_refusal_cooldown_s": 0.05})
    try:
        async def burst(stream: bool):
            c = openai.AsyncOpenAI(base_url=f.url + "/v1", api_key="alice", max_retries=0)

            async def one():
                if stream:
                    s = await c.completions.create(model="demo-llm", prompt="p", max_tokens=20, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
                    return [x.usage.completion_tokens async for x in s if x.usage][-1]
                r = await c.completions.create(model="demo-llm", prompt="p", max_tokens=20,
                                               extra_body={"ignore_eos": True})
                return r.usage.completion_tokens
            return await asyncio.gather(*(one() for _ in range(4)))

        for stream in (False, True):
            rejections_before = f.call(lambda: sum(f.engines[0][1].engine.counters.admission_rejections.values()))
            assert bg_loop.start_task(burst(stream)).result(60) == [20] * 4
            rejections = f.call(lambda: sum(f.engines[0][1].engine.counters.admission_rejections.values()))
            assert rejections > rejections_before, "the engine should have refused some"
        decisions = f.call(lambda: dict(f.gateway.core.stats.decisions))
        assert sum(n for k, n in decisions.items() if k[0] == "requeued") >= 2
        stats = f.call(lambda: f.gateway.core.stats)
        assert stats.outcomes["completed"] == 8 and stats.outcomes["failed"] == 0
        assert f.call(lambda: f.gateway.core.view.inflight) == 0
    finally:
        f.close()


@pytest.mark.parametrize("deadline,on_infeasible", [("first-attempt", "best-effort"), ("first-attempt", "refuse"),
                                                    ("fresh", "refuse")])
def test_an_openai_client_retry_keeps_its_first_deadline(bg_loop, deadline, on_infeasible):
    # a tenant allowed one request per second, with a 0.5 s TTFT SLO: its second request is
    # refused (429, Retry-After: 1), and the openai client sends it again a second later, saying
    # so in x-stainless-retry-count. Known again, the retry is already past its first deadline.
    slo = {"ttft_s": 0.5, "on_infeasible": on_infeasible}
    f = Fleet(bg_loop, [tenant("limited", slo=slo, rate_limit={"requests_per_s": 1, "request_burst": 1})],
              engines=1, engine_kwargs={"num_blocks": 2048, "max_num_seqs": 32}, speed=4.0,
              policy={"retries": {"deadline": deadline}})
    try:
        client = openai.OpenAI(base_url=f.url + "/v1", api_key="limited", max_retries=1)
        client.completions.create(model="demo-llm", prompt="a", max_tokens=1)
        if (deadline, on_infeasible) == ("first-attempt", "refuse"):
            with pytest.raises(openai.RateLimitError) as err:
                client.completions.create(model="demo-llm", prompt="b", max_tokens=1)
            assert err.value.response.json()["error"]["code"] == "retry_past_deadline"
        else:
            resp = client.completions.create(model="demo-llm", prompt="b", max_tokens=1)
            assert resp.usage.completion_tokens == 1  # fresh, or best-effort on an idle engine
        decisions = f.call(lambda: dict(f.gateway.core.stats.decisions))
        assert sum(n for k, n in decisions.items() if k[2] == "rate_limited_requests") == 1
        text = urllib.request.urlopen(f.url + "/metrics", timeout=5).read().decode()
        late = [line for line in text.splitlines()
                if line.startswith("bouncer_decisions_total") and 'reason="retry_past_deadline"' in line]
        if deadline == "fresh":
            assert late == []
        else:
            outcome = "demoted" if on_infeasible == "best-effort" else "refused"
            assert len(late) == 1 and f'outcome="{outcome}"' in late[0] and late[0].endswith(" 1.0")
    finally:
        f.close()
