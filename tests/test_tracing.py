"""OpenTelemetry traces: what the gateway exports over the network, decoded by an OTLP/gRPC
receiver (`bouncer.bench.otlp_sink`: the collector's TraceService from the opentelemetry-proto
definitions), not a mocked exporter; and the `traceparent` the engine receives."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from aiohttp import web

from bouncer.bench.otlp_sink import OtlpSink
from conftest import start_gateway
from gateway_setup import tenant
from servers import free_port, poll_until

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def attrs(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value if v.HasField("string_value") else v.int_value if v.HasField("int_value") \
            else v.double_value if v.HasField("double_value") else v.bool_value
    return out


def upstream_app(seen: list[str]) -> web.Application:
    """An OpenAI-compatible engine that records the traceparent each request brings."""
    async def models(_request):
        return web.json_response({"object": "list", "data": [{"id": "demo-llm", "object": "model"}]})

    async def chat(request: web.Request):
        seen.append(request.headers.get("traceparent", ""))
        body = await request.json()
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "demo-llm",
                 "choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}]}
        usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "chat.completion", "created": 0, "model": "demo-llm",
                                      "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                          "role": "assistant", "content": "hello there"}}], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.05)  # a first token worth a span
        for event in (chunk, chunk, {**chunk, "choices": [], "usage": usage}):
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def test_spans_reach_an_otlp_receiver_and_the_engine_continues_the_trace(bg_loop):
    sink_port = free_port()
    receiver = OtlpSink(sink_port, keep=True)
    seen: list[str] = []
    port = free_port()

    async def start():
        runner = web.AppRunner(upstream_app(seen))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner
    runner = bg_loop.run(start())
    config = {"tenants": [tenant("t", priority=3)],
              "models": [{"name": "demo-llm", "engine": "openai",
                          "backends": [{"url": f"http://127.0.0.1:{port}", "name": "e0"}]}],
              "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 1.0}},
              "tracing": {"endpoint": f"http://127.0.0.1:{sink_port}", "service_name": "bouncer-test"}}
    base, _plane, cleanup = start_gateway(bg_loop, config)
    try:
        traced = openai.OpenAI(base_url=base + "/v1", api_key="t", max_retries=0,
                               default_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        stream = traced.chat.completions.create(model="demo-llm", stream=True, max_tokens=4,
                                                messages=[{"role": "user", "content": "hi"}])
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "hellohello"
        plain = openai.OpenAI(base_url=base + "/v1", api_key="t", max_retries=0)
        assert plain.chat.completions.create(model="demo-llm", max_tokens=4,
                                             messages=[{"role": "user", "content": "hi"}]).choices
        try:
            openai.OpenAI(base_url=base + "/v1", api_key="nobody", max_retries=0).chat.completions.create(
                model="demo-llm", messages=[{"role": "user", "content": "hi"}])
        except openai.AuthenticationError:
            pass
        # the SDK exports in batches (every 5 s by default): the ten spans arrive by themselves
        poll_until(lambda: len(receiver.spans) >= 10, timeout=20, what="the spans exported")
    finally:
        cleanup()
        bg_loop.run(runner.cleanup())
        receiver.stop()

    spans = [s for service, s in receiver.spans if service == "bouncer-test"]
    by_trace: dict[str, list] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id.hex(), []).append(s)
    assert len(by_trace) == 3, {t: [s.name for s in ss] for t, ss in by_trace.items()}

    # the streamed request: under the client's span, the four spans
    ours = {s.name: s for s in by_trace[CLIENT_TRACE]}
    assert set(ours) == {"chat demo-llm", "bouncer.admission", "bouncer.first_token"} and \
        len(by_trace[CLIENT_TRACE]) == 4
    server = next(s for s in by_trace[CLIENT_TRACE] if s.kind == s.SPAN_KIND_SERVER)
    client = next(s for s in by_trace[CLIENT_TRACE] if s.kind == s.SPAN_KIND_CLIENT)
    assert server.parent_span_id.hex() == CLIENT_SPAN
    a = attrs(server)
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "demo-llm"
    assert a["gen_ai.usage.output_tokens"] == 2 and a["http.response.status_code"] == 200
    assert a["bouncer.tenant"] == "t" and a["bouncer.band"] == 3 and a["bouncer.outcome"] == "completed"
    admission = ours["bouncer.admission"]
    assert admission.parent_span_id == server.span_id
    assert attrs(admission)["bouncer.outcome"] == "admitted" and "bouncer.queue_wait_s" in attrs(admission)
    assert client.parent_span_id == server.span_id
    assert attrs(client)["server.port"] == port and attrs(client)["bouncer.replica"] == "e0"
    first = ours["bouncer.first_token"]
    assert first.parent_span_id == client.span_id
    assert first.end_time_unix_nano - first.start_time_unix_nano >= 40_000_000  # the engine's 50 ms
    assert server.start_time_unix_nano <= admission.start_time_unix_nano <= client.start_time_unix_nano
    assert client.end_time_unix_nano <= server.end_time_unix_nano

    # the engine got the upstream span's context, in the client's trace
    assert seen[0] == f"00-{CLIENT_TRACE}-{client.span_id.hex()}-01"
    # a request without a traceparent starts its own trace, and the engine continues that one
    plain_trace = next(t for t, ss in by_trace.items() if t != CLIENT_TRACE and len(ss) == 4)
    assert seen[1].split("-")[1] == plain_trace
    # a refused request: its span says who refused it and why (one without a key is refused on its
    # headers, its body never read: its span names no model)
    refused = next(ss for t, ss in by_trace.items() if t not in (CLIENT_TRACE, plain_trace))
    assert sorted(s.name for s in refused) == ["bouncer.admission", "chat"]
    root = next(s for s in refused if s.name == "chat")
    assert attrs(root)["http.response.status_code"] == 401 and attrs(root)["bouncer.outcome"] == "refused"
    adm = attrs(next(s for s in refused if s.name == "bouncer.admission"))
    assert adm["bouncer.outcome"] == "refused" and adm["bouncer.reason"] == "unauthenticated"


@pytest.mark.parametrize("follow", [False, True])
def test_a_clients_sampled_flag_decides_only_where_the_config_follows_it(bg_loop, follow):
    """With `sample_ratio: 0`, a client whose traceparent says sampled gets no trace exported
    (its flag would otherwise have every request of it traced at the gateway's cost), unless the
    config follows clients' sampling; the engine still gets the trace's context either way."""
    sink_port = free_port()
    receiver = OtlpSink(sink_port, keep=True)
    seen: list[str] = []
    port = free_port()

    async def start():
        runner = web.AppRunner(upstream_app(seen))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner
    runner = bg_loop.run(start())
    config = {"tenants": [tenant("t")],
              "models": [{"name": "demo-llm", "engine": "openai",
                          "backends": [{"url": f"http://127.0.0.1:{port}", "name": "e0"}]}],
              "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 1.0}},
              "tracing": {"endpoint": f"http://127.0.0.1:{sink_port}", "service_name": "sampling",
                          "sample_ratio": 0.0, "follow_client_sampling": follow}}
    base, plane, cleanup = start_gateway(bg_loop, config)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="t", max_retries=0,
                               default_headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        for _ in range(3):
            assert client.chat.completions.create(model="demo-llm", max_tokens=4,
                                                  messages=[{"role": "user", "content": "hi"}]).choices
        if follow:
            poll_until(lambda: len(receiver.spans) >= 3, timeout=20, what="the followed client's spans")
        else:
            assert plane.tracer.provider.force_flush(10_000)  # whatever was kept has been sent by now
            assert not receiver.spans
        assert all(s.split("-")[1] == CLIENT_TRACE for s in seen) and len(seen) == 3
    finally:
        cleanup()
        bg_loop.run(runner.cleanup())
        receiver.stop()
