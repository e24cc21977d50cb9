"""A deliberately fast OpenAI-compatible upstream, for measuring the gateway's own overhead.

It answers at once: a fixed completion, or a short event stream (16 content events, then usage
and [DONE]). `/metrics` reports an idle vLLM so the gateway scrapes it as a vLLM backend.

With `--pace-ms P` a stream is written as an engine writes it instead: `--paced-tokens` content
events, each its own write, P ms apart (what a proxy pays per token; `bench overhead`'s paced case).

    python -m bouncer.bench.fast_upstream --port 18300 [--pace-ms 20 --paced-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from bouncer.openai_wire import SSE_DONE, dumps, full_response, sse, stream_chunk, usage, usage_chunk

STREAM_EVENTS = 16

METRICS = b"""\
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="fast",engine="0"} 0.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="fast",engine="0"} 0.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="fast",engine="0"} 0.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="1000000"} 1.0
"""


def app(pace_s: float = 0.0, paced_tokens: int = 64) -> web.Application:
    kind_of = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
    full = {k: dumps(full_response(k, "x-1", "fast", 0, "hello " * STREAM_EVENTS, "length",
                                   usage(8, STREAM_EVENTS))) for k in ("chat", "completion")}
    streamed = {k: b"".join([sse(stream_chunk(k, "x-1", "fast", 0, "hello ", first=i == 0))
                             for i in range(STREAM_EVENTS)]
                            + [sse(stream_chunk(k, "x-1", "fast", 0, None, finish_reason="length")),
                               sse(usage_chunk(k, "x-1", "fast", 0, usage(8, STREAM_EVENTS))), SSE_DONE])
                for k in ("chat", "completion")}

    paced = {k: ([sse(stream_chunk(k, "x-1", "fast", 0, "hello ", first=i == 0)) for i in range(paced_tokens)],
                 sse(stream_chunk(k, "x-1", "fast", 0, None, finish_reason="length"))
                 + sse(usage_chunk(k, "x-1", "fast", 0, usage(8, paced_tokens))) + SSE_DONE)
             for k in ("chat", "completion")}

    async def generate(request: web.Request) -> web.StreamResponse:
        kind = kind_of[request.path]
        body = await request.read()
        if b'"stream":true' in body.replace(b" ", b""):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            try:
                await resp.prepare(request)
                if pace_s:
                    tokens, end = paced[kind]
                    for event in tokens:
                        await asyncio.sleep(pace_s)
                        await resp.write(event)
                    await resp.write(end)
                else:
                    await resp.write(streamed[kind])
                await resp.write_eof()
            except ConnectionResetError:
                pass  # the load generator hung up at the end of its run
            return resp
        return web.Response(body=full[kind], content_type="application/json")

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(body=METRICS, content_type="text/plain")

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fast", "object": "model"}]})

    a = web.Application(client_max_size=64 * 1024 * 1024)  # agent prompts of 100k+ tokens
    a.router.add_post("/v1/chat/completions", generate)
    a.router.add_post("/v1/completions", generate)
    a.router.add_get("/metrics", metrics)
    a.router.add_get("/v1/models", models)
    a.router.add_get("/health", lambda _request: web.Response(text="ok"))  # what routers probe
    return a


def main() -> None:
    ap = argparse.ArgumentParser(description="a fast OpenAI-compatible upstream")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=18300)
    ap.add_argument("--pace-ms", type=float, default=0.0, help="stream tokens one write each, this far apart")
    ap.add_argument("--paced-tokens", type=int, default=64, help="tokens of a paced stream")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    web.run_app(app(args.pace_ms / 1000, args.paced_tokens), host=args.host, port=args.port, access_log=None,
                print=None, handle_signals=True, backlog=1024)


if __name__ == "__main__":
    main()
