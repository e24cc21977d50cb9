"""`bouncer bench overhead`'s paced stream case: what a proxy costs per streamed token when the
tokens come as an engine sends them, one write each, 20 ms apart (wrk's stream case gets a whole
answer in one write, which hides this cost).

A paced upstream (`fast_upstream --pace-ms 20 --paced-tokens 64`) and this module's client run on
one core; each proxy in turn on the other. The client keeps N streams open for a few seconds (a
new request as each ends), counting the events it reads and each request's time to its first
byte. The proxy's CPU (every process of it: Envoy and the picker together) over the tokens
delivered is the figure to compare; TTFB percentiles say what a held-back event loop costs.

    python -m bouncer.bench.paced_streams --url URL --streams 256 --seconds 8   (the client alone)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

PACE_MS = 20.0
PACED_TOKENS = 64


@dataclass
class PacedRun:
    target: str
    streams: int
    seconds: float
    requests: int
    tokens: int
    errors: int
    ttfb_p50_ms: float
    ttfb_p99_ms: float
    cpu_ms_per_1k_tokens: float  # the proxy's processes' CPU over the tokens the client read


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _drive(url: str, key: str, streams: int, seconds: float, tokens: int = PACED_TOKENS) -> dict:
    import aiohttp

    body = json.dumps({"model": "fast", "prompt": "paced", "max_tokens": tokens, "stream": True})
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    deadline = time.monotonic() + seconds
    ttfbs: list[float] = []
    counts = {"requests": 0, "tokens": 0, "errors": 0}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def loop() -> None:
            while time.monotonic() < deadline:
                t0 = time.monotonic()
                try:
                    async with session.post(url, data=body, headers=headers) as resp:
                        if resp.status != 200:
                            counts["errors"] += 1
                            await resp.read()
                            continue
                        first = True
                        async for line in resp.content:
                            if first:
                                ttfbs.append(time.monotonic() - t0)
                                first = False
                            if line.startswith(b"data: {") and b'"text":"hello' in line.replace(b" ", b""):
                                counts["tokens"] += 1
                    counts["requests"] += 1
                except aiohttp.ClientError:
                    counts["errors"] += 1

        await asyncio.gather(*(loop() for _ in range(streams)))
    return {**counts, "ttfb_p50_ms": _percentile(ttfbs, 0.5) * 1000, "ttfb_p99_ms": _percentile(ttfbs, 0.99) * 1000,
            "ttfb_median_all_ms": statistics.median(ttfbs) * 1000 if ttfbs else float("nan")}


def measure(target: str, url: str, pids: list[int], key: str, streams: int, seconds: float, client_cpu: int,
            pinned, cpu_seconds, tokens: int = PACED_TOKENS) -> PacedRun:
    """One run of the client (its own process on `client_cpu`) against `url`, the CPU of `pids`
    counted over it."""
    cpu0 = sum(cpu_seconds(p, children=True) for p in pids)
    t0 = time.monotonic()
    out = subprocess.run([*pinned(client_cpu), sys.executable, "-m", "bouncer.bench.paced_streams", "--url", url,
                          "--key", key, "--streams", str(streams), "--seconds", str(seconds),
                          "--tokens", str(tokens)],
                         capture_output=True, text=True, timeout=seconds + 180)
    elapsed = time.monotonic() - t0
    cpu = sum(cpu_seconds(p, children=True) for p in pids) - cpu0
    if out.returncode != 0:
        raise RuntimeError(f"the paced client failed: {out.stderr[-2000:]}")
    r = json.loads(out.stdout)
    return PacedRun(target, streams, round(elapsed, 2), r["requests"], r["tokens"], r["errors"],
                    round(r["ttfb_p50_ms"], 2), round(r["ttfb_p99_ms"], 2),
                    round(cpu * 1000 / max(1, r["tokens"]) * 1000, 2))


def report(runs: list[PacedRun], baseline: str = "vllm-router") -> str:
    by = {(r.target, r.streams): r for r in runs}
    lines = [f"| streams | proxy | tokens/s | CPU ms per 1,000 tokens | over {baseline} | TTFB p50 / p99 ms | "
             "errors |", "|---|---|---|---|---|---|---|"]
    for (target, streams), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        base = by.get((baseline, streams))
        ratio = f"{r.cpu_ms_per_1k_tokens / base.cpu_ms_per_1k_tokens:.2f}x" if base and target != "direct" else ""
        lines.append(f"| {streams} | {target} | {r.tokens / r.seconds:,.0f} | "
                     f"{'' if target == 'direct' else f'{r.cpu_ms_per_1k_tokens:.1f}'} | {ratio} | "
                     f"{r.ttfb_p50_ms:.1f} / {r.ttfb_p99_ms:.1f} | {r.errors} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description="keep N paced streams open against a URL; print what was read")
    ap.add_argument("--url", required=True)
    ap.add_argument("--key", default="bench-key")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--tokens", type=int, default=PACED_TOKENS, help="each answer's length (the upstream's too)")
    args = ap.parse_args()
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    print(json.dumps(asyncio.run(_drive(args.url, args.key, args.streams, args.seconds, args.tokens))))


if __name__ == "__main__":
    main()
