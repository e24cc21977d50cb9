"""Replay a workload JSONL against an OpenAI-compatible server and record timings + engine metrics.

    .venv/bin/python scripts/fidelity/replay.py --base-url http://127.0.0.1:18200 --model tiny \\
        --workload scripts/fidelity/workload.jsonl --out scripts/fidelity/results/vllm-cpu.json

Every request is sent at its `t` (seconds after start) to POST /v1/completions with stream=true,
stream_options.include_usage, ignore_eos=true, temperature 0 and its max_tokens. Per request it
records (all times in seconds since the replay start): send, first_token (first streamed event that
carries a choice), finish (end of the stream), chunk_times (every event carrying a choice; omit with
--no-chunk-times), prompt_tokens/completion_tokens from the final usage event, HTTP status, and any
error (including an error event inside an HTTP-200 stream, which vLLM sends for some refusals).
Meanwhile it polls GET /metrics every --poll seconds and records, per poll, the value of each
metric sample name in METRICS (summed over label sets; null when absent). It works against any
server exporting those names (real vLLM, or Bouncer's simulated engine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import time

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

METRICS = [
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
]


def parse_metrics(text: str, names: list[str]) -> dict[str, float | None]:
    """Sum samples by exact sample name (counters keep their `_total` sample name here)."""
    wanted = set(names)
    out: dict[str, float | None] = {n: None for n in names}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in wanted:
                out[s.name] = (out[s.name] or 0.0) + float(s.value)
    return out


async def poll_metrics(session: aiohttp.ClientSession, url: str, names: list[str], period: float,
                       t0: float, stop: asyncio.Event, series: dict) -> None:
    series["t"] = []
    for n in names:
        series[n] = []
    errors = 0
    while not stop.is_set():
        start = time.perf_counter()
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                text = await r.text()
            vals = parse_metrics(text, names)
            series["t"].append(round(start - t0, 4))
            for n in names:
                v = vals[n]
                series[n].append(None if v is None else round(v, 6))
        except Exception:  # noqa: BLE001 - a missed poll is recorded as a count, not fatal
            errors += 1
        try:
            await asyncio.wait_for(stop.wait(), max(0.0, period - (time.perf_counter() - start)))
        except TimeoutError:
            pass
    series["poll_errors"] = errors


async def one_request(session: aiohttp.ClientSession, url: str, model: str, req: dict, t0: float,
                      keep_chunks: bool, timeout: float) -> dict:
    delay = req["t"] - (time.perf_counter() - t0)
    if delay > 0:
        await asyncio.sleep(delay)
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    rec: dict = {"id": req.get("id"), "t_sched": req["t"], "max_tokens": req["max_tokens"],
                 "send": None, "first_token": None, "finish": None, "status": None,
                 "prompt_tokens": None, "completion_tokens": None, "error": None, "n_chunks": 0}
    chunks: list[float] = []
    rec["send"] = round(time.perf_counter() - t0, 4)
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            rec["status"] = r.status
            rec["retry_after"] = r.headers.get("Retry-After")
            if r.status != 200:
                rec["error"] = (await r.text())[:500]
            else:
                buf = b""
                async for data in r.content.iter_any():
                    now = time.perf_counter() - t0
                    buf += data
                    while b"\n\n" in buf:
                        event, buf = buf.split(b"\n\n", 1)
                        for line in event.split(b"\n"):
                            if not line.startswith(b"data:"):
                                continue
                            payload = line[5:].strip()
                            if payload == b"[DONE]":
                                continue
                            msg = json.loads(payload)
                            if "error" in msg:
                                rec["error"] = json.dumps(msg["error"])[:500]
                                continue
                            if msg.get("choices"):
                                if rec["first_token"] is None:
                                    rec["first_token"] = round(now, 4)
                                chunks.append(round(now, 4))
                            if msg.get("usage"):
                                rec["prompt_tokens"] = msg["usage"].get("prompt_tokens")
                                rec["completion_tokens"] = msg["usage"].get("completion_tokens")
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
    rec["finish"] = round(time.perf_counter() - t0, 4)
    rec["n_chunks"] = len(chunks)
    if keep_chunks:
        rec["chunk_times"] = chunks
    return rec


async def replay(base_url: str, model: str, workload: list[dict], poll: float, keep_chunks: bool,
                 timeout: float, names: list[str], settle: float) -> dict:
    base = base_url.rstrip("/")
    # Idle keep-alive connections are dropped after 3 s, before uvicorn's 5 s server-side timeout,
    # so no request is written to a connection the server is closing.
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    async with aiohttp.ClientSession(connector=conn) as session:
        async with session.get(f"{base}/metrics") as r:
            before = parse_metrics(await r.text(), names)
        t0 = time.perf_counter()
        wall0 = time.time()
        stop = asyncio.Event()
        series: dict = {}
        poller = asyncio.create_task(poll_metrics(session, f"{base}/metrics", names, poll, t0, stop, series))
        recs = await asyncio.gather(*(one_request(session, f"{base}/v1/completions", model, q, t0,
                                                  keep_chunks, timeout) for q in workload))
        await asyncio.sleep(settle)  # let gauges fall back to idle in the series
        stop.set()
        await poller
        async with session.get(f"{base}/metrics") as r:
            after = parse_metrics(await r.text(), names)
    done = sorted((r for r in recs if r["finish"] is not None), key=lambda r: r["finish"])
    for rank, r in enumerate(done):
        r["completion_rank"] = rank
    ok = [r for r in recs if r["status"] == 200 and r["error"] is None]
    return {
        "base_url": base, "model": model, "started_unix": wall0, "poll_period_s": poll,
        "n_requests": len(recs), "n_ok": len(ok),
        "completion_order": [r["id"] for r in done],
        "metrics_before": before, "metrics_after": after,
        "requests": recs, "series": series,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--poll", type=float, default=0.25, help="metrics poll period (s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds to keep polling after the last request")
    ap.add_argument("--no-chunk-times", action="store_true", help="do not store per-chunk timestamps")
    ap.add_argument("--metric", action="append", default=[], help="extra metric sample name to record")
    a = ap.parse_args()
    workload = [json.loads(line) for line in pathlib.Path(a.workload).read_text().splitlines() if line.strip()]
    for i, q in enumerate(workload):
        q.setdefault("id", i)
    names = METRICS + [m for m in a.metric if m not in METRICS]
    result = asyncio.run(replay(a.base_url, a.model, workload, a.poll, not a.no_chunk_times,
                                a.timeout, names, a.settle))
    result["workload"] = a.workload
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, separators=(",", ":")))
    reqs = result["requests"]
    ok = [r for r in reqs if r["status"] == 200 and r["error"] is None]
    ttft = sorted(r["first_token"] - r["send"] for r in ok if r["first_token"] is not None)
    e2e = max((r["finish"] for r in reqs), default=0.0)
    ma = result["metrics_after"]
    mb = result["metrics_before"]
    delta = {k: (None if ma[k] is None or mb[k] is None else ma[k] - mb[k]) for k in ma if k.endswith("_total")}
    print(f"wrote {out} ({out.stat().st_size} bytes): {len(ok)}/{len(reqs)} ok, makespan {e2e:.1f} s, "
          f"TTFT p50 {ttft[len(ttft) // 2] if ttft else float('nan'):.3f} s, "
          f"p90 {ttft[int(len(ttft) * 0.9)] if ttft else float('nan'):.3f} s; counter deltas {delta}; "
          f"{len(result['series']['t'])} metric polls")
    bad = [r for r in reqs if r not in ok]
    for r in bad[:5]:
        print("  failed:", r["id"], r["status"], r["error"])


if __name__ == "__main__":
    main()
