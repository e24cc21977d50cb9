"""Overload one OpenAI-compatible server with concurrent streaming requests and watch its vLLM metrics.

    bouncer engine --port 18101 --kv-blocks 256 --max-num-seqs 16 &
    python scripts/engine_overload.py --url http://127.0.0.1:18101 --requests 200 --prompt-tokens 1000

Sends all requests at once (prompts of distinct token ids, so no prefix sharing), samples
/metrics every 0.5 s, and prints KV usage, waiting queue and preemptions over time and how many
requests completed. Bounded: it stops after --timeout seconds whatever happens. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

WATCHED = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
           "vllm:num_preemptions_total")


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in WATCHED:
                out[s.name] = s.value
    return out


async def one(session: aiohttp.ClientSession, url: str, model: str, i: int, prompt_tokens: int,
              max_tokens: int) -> tuple[int, int]:
    body = {"model": model, "prompt": [i % 2000 + 4] + [(i * 7 + k) % 2000 + 4 for k in range(prompt_tokens - 1)],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return 200, tokens


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:18101")
    ap.add_argument("--model", default="demo-llm")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", help="write the samples and results as JSON")
    args = ap.parse_args()
    if not args.url.startswith(("http://127.", "http://localhost")):
        raise SystemExit("loopback targets only")
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=args.timeout)) as s:
        t0 = time.monotonic()
        tasks = [asyncio.create_task(one(s, args.url, args.model, i, args.prompt_tokens, args.max_tokens))
                 for i in range(args.requests)]
        samples = []
        while not all(t.done() for t in tasks) and time.monotonic() - t0 < args.timeout:
            m = await scrape(s, args.url)
            samples.append({"t": round(time.monotonic() - t0, 2), **m})
            await asyncio.sleep(0.5)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    ok = [r for r in results if isinstance(r, tuple) and r[0] == 200 and r[1] == args.max_tokens]
    print(f"{'t':>6} {'kv_usage':>9} {'running':>8} {'waiting':>8} {'preempt':>8}")
    for smp in samples[:: max(1, len(samples) // 25)]:
        print(f"{smp['t']:6.1f} {smp.get('vllm:kv_cache_usage_perc', 0):9.2f} "
              f"{smp.get('vllm:num_requests_running', 0):8.0f} {smp.get('vllm:num_requests_waiting', 0):8.0f} "
              f"{smp.get('vllm:num_preemptions_total', 0):8.0f}")
    waiting = [smp.get("vllm:num_requests_waiting", 0) for smp in samples]
    print(f"completed {len(ok)}/{args.requests} with {args.max_tokens} tokens each in "
          f"{time.monotonic() - t0:.1f} s; max KV usage "
          f"{max(smp.get('vllm:kv_cache_usage_perc', 0) for smp in samples):.2f}, max waiting "
          f"{max(waiting):.0f}, preemptions {samples[-1].get('vllm:num_preemptions_total', 0):.0f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"samples": samples, "completed": len(ok), "requests": args.requests}, f)


if __name__ == "__main__":
    asyncio.run(main())
