"""`bouncer bench flood`: the rogue drill. The demo's fleet (two `bouncer engine` replicas of
1,024 KV blocks, the demo's gateway config) with the gateway in its own process, pinned to its
own core where `taskset` exists; 300 clients of the sheddable `free` tenant in a loop, each
sending a new ~3,000-token prompt as soon as its last one is answered (refused or not, ignoring
Retry-After), and one `interactive` client streaming short requests one after another. What it
prints: the interactive tenant's completions, their TTFT (p50, p99, worst) against its 1 s SLO
and the longest gap between two of them; what the flood got, by status; and the gateway's CPU
over the run, per request it answered and per refusal.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import pathlib
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter

import aiohttp

from bouncer.bench.loopback import cpu_seconds, free_port, pinned, runqueue_wait_seconds, stop, wait_ok
from bouncer.demo import DEMO_KV_BLOCKS, DEMO_MAX_NUM_SEQS, DEMO_MODEL, DEMO_PROFILE, demo_config

FLOOD_WORDS = 1100  # about 3,000 tokens with the bundled tokenizer


def _gateway_view(base: str) -> tuple[dict[str, int], dict[str, float | None]]:
    """From the gateway's /metrics: how requests ended, by tenant, outcome and reason; the
    interactive tenant's mean queue wait and TTFT as the gateway saw them (from arrival); and
    its event loop's lag (p99, as the histogram's bucket bound)."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    ends: dict[str, int] = {}
    sums: dict[str, float] = {}
    lag_buckets: dict[float, float] = {}
    for line in text.splitlines():
        if not line.startswith("bouncer_") or "{" not in line:
            continue
        name = line[:line.index("{")]
        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1:line.index("}")].split(","))
        labels = {k: v.strip('"') for k, v in labels.items()}
        value = float(line.rsplit(" ", 1)[1])
        if name == "bouncer_decisions_total":
            key = f"{labels['tenant']} {labels['outcome']} {labels['reason']}"
            ends[key] = ends.get(key, 0) + int(value)
        elif name == "bouncer_event_loop_lag_seconds_bucket":
            lag_buckets[float(labels["le"])] = value
        elif labels.get("tenant") == "interactive" and name in (
                "bouncer_queue_wait_seconds_sum", "bouncer_queue_wait_seconds_count", "bouncer_ttft_seconds_sum",
                "bouncer_ttft_seconds_count"):
            sums[name] = sums.get(name, 0.0) + value

    def mean(metric: str) -> float | None:
        n = sums.get(f"{metric}_count")
        return round(sums[f"{metric}_sum"] / n, 3) if n else None
    return dict(sorted(ends.items())), {"queue_wait_mean_s": mean("bouncer_queue_wait_seconds"),
                                        "ttft_mean_s": mean("bouncer_ttft_seconds"),
                                        "loop_lag_p99_s_at_most": _bucket_quantile(lag_buckets, 0.99)}


def _bucket_quantile(buckets: dict[float, float], q: float) -> float | None:
    """The upper bound of the histogram bucket the q-quantile falls in (cumulative counts by le)."""
    total = buckets.get(float("inf"))
    if not total:
        return None
    for le in sorted(buckets):
        if buckets[le] >= q * total:
            return le
    return None


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _flood(base: str, clients: int, seconds: float) -> dict[str, int]:
    stop = time.monotonic() + seconds
    flood: Counter = Counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def rogue(i: int) -> None:
            n = 0
            while time.monotonic() < stop:
                words = " ".join(f"w{(i * 131 + n * 17 + j) % 4999}" for j in range(FLOOD_WORDS))
                body = {"model": DEMO_MODEL, "max_tokens": 128,
                        "messages": [{"role": "user", "content": f"client {i} request {n}: {words}"}]}
                n += 1
                try:
                    async with session.post(base + "/v1/chat/completions", json=body,
                                            headers={"Authorization": "Bearer demo-free"}) as resp:
                        await resp.read()
                        flood[resp.status] += 1
                except (aiohttp.ClientError, TimeoutError):
                    flood["error"] += 1
        await asyncio.gather(*(rogue(i) for i in range(clients)))
    return {str(k): v for k, v in sorted(flood.items(), key=str)}


async def _interactive(base: str, seconds: float) -> dict:
    stop = time.monotonic() + seconds
    ttfts: list[float] = []
    done_at: list[float] = []
    failed: Counter = Counter()
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        n = 0
        while time.monotonic() < stop:
            body = {"model": DEMO_MODEL, "max_tokens": 16, "stream": True,
                    "messages": [{"role": "user", "content": f"quick question {n}?"}]}
            n += 1
            t0 = time.monotonic()
            first = None
            try:
                async with session.post(base + "/v1/chat/completions", json=body,
                                        headers={"Authorization": "Bearer demo-interactive"}) as resp:
                    if resp.status != 200:
                        failed[resp.status] += 1
                        await resp.read()
                        continue
                    async for line in resp.content:
                        if first is None and line.startswith(b"data: {") and b'"content"' in line:
                            first = time.monotonic() - t0
                if first is not None:
                    ttfts.append(first)
                    done_at.append(time.monotonic())
            except (aiohttp.ClientError, TimeoutError):
                failed["error"] += 1
    gaps = [b - a for a, b in zip([started, *done_at], done_at, strict=False)]
    return {"completed": len(ttfts), "failed": {str(k): v for k, v in failed.items()},
            "ttft_p50_s": _percentile(ttfts, 0.5), "ttft_p99_s": _percentile(ttfts, 0.99),
            "ttft_max_s": max(ttfts, default=None), "longest_gap_s": max(gaps, default=None)}


def _interactive_process(base: str, seconds: float, out) -> None:
    out.put(asyncio.run(_interactive(base, seconds)))


def _drive(base: str, clients: int, seconds: float) -> dict:
    """The flood from this process, the interactive client from its own (so that its latency is
    not the flood's event loop's)."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    client = ctx.Process(target=_interactive_process, args=(base, seconds, results))
    client.start()
    # the flood's clients (the heaviest process here) share the engines' core, not the
    # gateway's: what the gateway can do is measured, not what is left of a core they share
    cores = os.sched_getaffinity(0)
    if len(pinned(0)) and len(cores) > 1:
        os.sched_setaffinity(0, {0})
    try:
        flood = asyncio.run(_flood(base, clients, seconds))
    finally:
        os.sched_setaffinity(0, cores)
    interactive = results.get(timeout=300)
    client.join(30)
    return {"flood_by_status": flood, "interactive": interactive}


def run(clients: int = 300, seconds: float = 30.0, gateway_pythonpath: str | None = None) -> dict:
    gw_port, engines = free_port(), (free_port(), free_port())
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        config = demo_config(port=gw_port, engine_ports=engines)
        path = pathlib.Path(tmp) / "gateway.json"
        # only what differs from the defaults: another checkout's gateway may not know newer fields
        dumped = config.model_dump(mode="json", exclude_defaults=True) | {"logging": {"level": "warning"}}
        path.write_text(json.dumps(dumped))
        env = dict(os.environ)
        if gateway_pythonpath:  # another checkout's gateway, to compare commits
            env["PYTHONPATH"] = gateway_pythonpath
        try:
            for p in engines:
                procs.append(subprocess.Popen([*pinned(0), sys.executable, "-m", "bouncer", "engine", "--port", str(p),
                                               "--model", DEMO_MODEL, "--profile", DEMO_PROFILE,
                                               "--kv-blocks", str(DEMO_KV_BLOCKS),
                                               "--max-num-seqs", str(DEMO_MAX_NUM_SEQS), "--max-model-len", "8192"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            gateway = subprocess.Popen([*pinned(1), sys.executable, "-m", "bouncer", "serve", "--config", str(path)],
                                       stdout=subprocess.DEVNULL, env=env)
            procs.append(gateway)
            base = f"http://127.0.0.1:{gw_port}"
            wait_ok(base + "/ready")
            cpu0, t0 = cpu_seconds(gateway.pid), time.monotonic()
            waited0 = runqueue_wait_seconds(gateway.pid)
            result = _drive(base, clients, seconds)
            cpu, wall = cpu_seconds(gateway.pid) - cpu0, time.monotonic() - t0
            waited = runqueue_wait_seconds(gateway.pid) - waited0
            result["gateway_ends"], result["interactive_in_gateway"] = _gateway_view(base)
        finally:
            stop(procs)
    answered = sum(v for k, v in result["flood_by_status"].items() if k != "error") + \
        result["interactive"]["completed"] + sum(result["interactive"]["failed"].values())
    refused = sum(v for k, v in result["flood_by_status"].items() if k not in ("200", "error"))
    result.update(clients=clients, seconds=round(wall, 1), gateway_cpu_s=round(cpu, 2),
                  gateway_cpu_share=round(cpu / wall, 3), gateway_runqueue_wait_s=round(waited, 2),
                  answered=answered, refused=refused,
                  gateway_cpu_us_per_answer=round(cpu / max(1, answered) * 1e6, 1))
    return result


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def report(r: dict) -> str:
    i = r["interactive"]
    fmt = _s
    return "\n".join([
        f"rogue drill: {r['clients']} sheddable clients looping on ~3,000-token prompts, one interactive client, "
        f"{r['seconds']:g} s",
        f"  interactive: {i['completed']} completed, failed {i['failed'] or 0}; TTFT p50 {fmt(i['ttft_p50_s'])} s, "
        f"p99 {fmt(i['ttft_p99_s'])} s, worst {fmt(i['ttft_max_s'])} s (SLO 1 s); longest gap between "
        f"completions {fmt(i['longest_gap_s'])} s",
        f"  flood: {r['flood_by_status']}",
        f"  the gateway's count: {r['gateway_ends']}",
        f"  in the gateway (the interactive tenant's means from arrival; its loop's lag): "
        f"{r['interactive_in_gateway']}",
        f"  gateway: {r['gateway_cpu_s']} s of CPU ({r['gateway_cpu_share']:.0%} of a core) for {r['answered']:,} "
        f"answers, {r['refused']:,} of them refusals: {r['gateway_cpu_us_per_answer']:.0f} us per answer; "
        f"its threads waited {r['gateway_runqueue_wait_s']} s in all for a CPU (runnable, not running: "
        f"the rest of the machine, or each other)"])


def main(clients: int, seconds: float, out: str | None, gateway_pythonpath: str | None) -> None:
    result = run(clients, seconds, gateway_pythonpath)
    print(report(result))
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=2))
        print(f"saved {out}")
