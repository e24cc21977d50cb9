"""`bouncer bench gateways`: several gateway processes behind one spreading client, with and
without the Redis they can share.

Real processes: a `redis-server` of its own, N `bouncer serve` gateways on one config, M
`bouncer engine` replicas. A client spreads each request over the gateways in turn (as a load
balancer spreading connections does, on average) at fixed rates, open loop:
- `limited`: limited to LIMITED_RPS requests/s (burst as many), offered three times that;
- `tokens`: limited to TOKENS_PER_MIN prompt + max_tokens a minute (2 s of it as burst),
  offered three times that;
- `top`: no limit, priority 10, a steady trickle (it must not notice either way).
The same load runs twice: each gateway alone (no `shared_state`), and sharing Redis. What it
prints per tenant: what was offered, admitted (200) and refused (by status), the admitted rate
against the limit, and the gateways' CPU (all of them, in cores: at these rates most of it is
their background work, scraping the engines). Alone, N gateways admit about N times each
limit; sharing, about the limit once (plus the burst at the start). Then what sharing costs
one gateway per request (`cost`, with wrk).
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from collections import Counter

import aiohttp

from bouncer.bench.loopback import RedisServer, cpu_seconds, free_port, stop, wait_ok
from bouncer.config import key_digest
from bouncer.tokenizer import default_tokenizer_path

LIMITED_RPS = 10.0
TOKENS_PER_MIN = 12_000.0
PROMPT = "Summarise the state of the fleet in one line, please."
MAX_TOKENS = 16
TENANTS = {  # name: (requests/s offered, its rate limit, priority)
    "limited": (3 * LIMITED_RPS, {"requests_per_s": LIMITED_RPS, "request_burst": int(LIMITED_RPS)}, 0),
    "tokens": (None, {"tokens_per_min": TOKENS_PER_MIN, "token_burst": int(TOKENS_PER_MIN / 30)}, 0),
    "top": (4.0, {}, 10),
}


def _config(port: int, engines: list[str], redis_url: str | None) -> dict:
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "logging": {"level": "warning", "access_log": False},
        "recorder": {"enabled": False},
        "tenants": [{"name": name, "api_keys_sha256": [key_digest(name)], "priority": priority,
                     "rate_limit": limit} for name, (_, limit, priority) in TENANTS.items()],
        "models": [{"name": "demo-llm", "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                    "max_model_len": 4096,
                    "backends": [{"url": url, "name": f"e{i}"} for i, url in enumerate(engines)]}],
    }
    if redis_url:
        config["shared_state"] = {"url": redis_url, "key_prefix": "bench:"}
    return config


async def _load(gateways: list[str], seconds: float, token_charge: int) -> dict[str, Counter]:
    """Open loop: each tenant's requests at its rate, each to the next gateway in turn."""
    rates = {"limited": TENANTS["limited"][0], "tokens": 3 * TOKENS_PER_MIN / 60 / token_charge,
             "top": TENANTS["top"][0]}
    results: dict[str, Counter] = {name: Counter() for name in TENANTS}
    turn = 0
    # every answer as long as max_tokens: a token charge is settled at what was used, and so each
    # request uses exactly the charge `_token_charge` counts
    body = {"model": "demo-llm", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "ignore_eos": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        async def one(tenant: str, url: str) -> None:
            try:
                async with session.post(url, json=body, headers={"Authorization": f"Bearer {tenant}"}) as resp:
                    await resp.read()
                    results[tenant][str(resp.status)] += 1
            except (aiohttp.ClientError, TimeoutError):
                results[tenant]["error"] += 1

        async def tenant_load(tenant: str, rate: float) -> None:
            nonlocal turn
            tasks = []
            start = time.monotonic()
            n = 0
            while (due := start + n / rate) < start + seconds:
                await asyncio.sleep(max(0.0, due - time.monotonic()))
                url = gateways[turn % len(gateways)] + "/v1/chat/completions"
                turn += 1
                n += 1
                tasks.append(asyncio.create_task(one(tenant, url)))
            await asyncio.gather(*tasks)

        await asyncio.gather(*(tenant_load(t, r) for t, r in rates.items()))
    return results


def _token_charge() -> int:
    """What one request charges the token bucket: its prompt's tokens (the bundled tokenizer
    through the chat template) plus max_tokens."""
    from bouncer.gateway.request_parsing import prompt_token_ids
    from bouncer.tokenizer import PromptTokenizer

    tok = PromptTokenizer(str(default_tokenizer_path()))
    return len(prompt_token_ids("chat", {"messages": [{"role": "user", "content": PROMPT}]}, tok)) + MAX_TOKENS


def _run_once(gateways: int, engines: list[str], redis: RedisServer | None, seconds: float, work: pathlib.Path,
              token_charge: int) -> dict:
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for i in range(gateways):
            port = free_port()
            path = work / f"gateway-{i}-{'shared' if redis else 'alone'}.json"
            path.write_text(json.dumps(_config(port, engines, redis.url if redis else None)))
            procs.append(subprocess.Popen([sys.executable, "-m", "bouncer", "serve", "--config", str(path)],
                                          stdout=subprocess.DEVNULL))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_ok(url + "/ready")
        time.sleep(1.0)  # the gateways have counted each other in Redis
        cpu0 = sum(cpu_seconds(p.pid) for p in procs)
        redis_cpu0 = cpu_seconds(redis.proc.pid) if redis else 0.0
        t0 = time.monotonic()
        results = asyncio.run(_load(urls, seconds, token_charge))
        wall = time.monotonic() - t0
        cpu = sum(cpu_seconds(p.pid) for p in procs) - cpu0
    finally:
        stop(procs)
    requests = sum(sum(c.values()) for c in results.values())
    tenants = {}
    for name, counts in results.items():
        ok = counts.get("200", 0)
        limit = TENANTS[name][1]
        tenant = {"offered": sum(counts.values()), "by_status": dict(sorted(counts.items())),
                  "admitted_per_s": round(ok / wall, 2)}
        if "requests_per_s" in limit:
            # what the limit allows over the run: its burst at the start, then its rate
            tenant["allowed_per_s"] = round((limit["request_burst"] + limit["requests_per_s"] * wall) / wall, 2)
        elif "tokens_per_min" in limit:
            allowed_tokens = limit["token_burst"] + limit["tokens_per_min"] / 60 * wall
            tenant["allowed_per_s"] = round(allowed_tokens / token_charge / wall, 2)
        if "allowed_per_s" in tenant:
            tenant["admitted_over_allowed"] = round(tenant["admitted_per_s"] / tenant["allowed_per_s"], 2)
        tenants[name] = tenant
    return {"shared": redis is not None, "seconds": round(wall, 1), "tenants": tenants, "requests": requests,
            "gateways_cpu_cores": round(cpu / wall, 3),
            "redis_cpu_cores": round((cpu_seconds(redis.proc.pid) - redis_cpu0) / wall, 4) if redis else None}


def run(gateways: int = 3, engines: int = 4, seconds: float = 20.0) -> dict:
    if gateways < 2:
        raise SystemExit("bouncer bench gateways: --gateways must be at least 2")
    procs: list[subprocess.Popen] = []
    redis = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            urls = []
            for _ in range(engines):
                port = free_port()
                procs.append(subprocess.Popen([sys.executable, "-m", "bouncer", "engine", "--port", str(port),
                                               "--model", "demo-llm", "--speed", "4"],
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                urls.append(f"http://127.0.0.1:{port}")
            for url in urls:
                wait_ok(url + "/health")
            token_charge = _token_charge()
            alone = _run_once(gateways, urls, None, seconds, pathlib.Path(tmp), token_charge)
            redis = RedisServer()
            shared = _run_once(gateways, urls, redis, seconds, pathlib.Path(tmp), token_charge)
        finally:
            stop(procs)
            if redis is not None:
                redis.stop()
    return {"gateways": gateways, "engines": engines, "token_charge": token_charge, "runs": [alone, shared]}


def cost(rounds: int = 3, seconds: int = 4) -> dict:
    """What sharing costs one gateway per request: `wrk` against two gateways in front of the
    fast upstream, one deciding a (never reached) rate limit alone, one asking Redis; alternating
    rounds at concurrency 1 and 16, medians. None where wrk is missing."""
    import shutil
    import statistics

    from bouncer.bench.loopback import pinned
    from bouncer.bench.overhead import _gateway_config, _wrk

    if not shutil.which("wrk"):
        return {"missing": "wrk (apt-get install wrk)"}
    redis = RedisServer()
    up = free_port()
    procs = [subprocess.Popen([*pinned(0), sys.executable, "-m", "bouncer.bench.fast_upstream", "--port", str(up)])]
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            gateways = {}
            for name in ("alone", "sharing"):
                port = free_port()
                cfg = json.loads(_gateway_config(f"http://127.0.0.1:{up}", port, recorder=False))
                cfg["models"][0]["tokenizer"] = str(default_tokenizer_path())
                cfg["tenants"][0]["rate_limit"] = {"requests_per_s": 1e6, "tokens_per_min": 1e12}
                if name == "sharing":
                    cfg["shared_state"] = {"url": redis.url, "key_prefix": "cost:"}
                path = pathlib.Path(tmp) / f"{name}.json"
                path.write_text(json.dumps(cfg))
                p = subprocess.Popen([*pinned(1), sys.executable, "-m", "bouncer", "serve", "--config", str(path),
                                      "--log-level", "warning"], stdout=subprocess.DEVNULL)
                procs.append(p)
                gateways[name] = (f"http://127.0.0.1:{port}/v1/chat/completions", p.pid)
            wait_ok(f"http://127.0.0.1:{up}/metrics")
            for url, _ in gateways.values():
                wait_ok(url.rsplit("/v1/", 1)[0] + "/ready")
            for c in (1, 16):
                rows: dict[str, list] = {name: [] for name in gateways}
                for i in range(rounds):
                    for name in (("alone", "sharing") if i % 2 == 0 else ("sharing", "alone")):
                        url, pid = gateways[name]
                        _wrk(url, False, c, 1, pathlib.Path(tmp))  # warm-up
                        cpu0, redis0 = cpu_seconds(pid), cpu_seconds(redis.proc.pid)
                        rps, p50, _, errors, total = _wrk(url, False, c, seconds, pathlib.Path(tmp))
                        rows[name].append(((cpu_seconds(pid) - cpu0) / max(1, total) * 1e6, p50, rps, errors,
                                           (cpu_seconds(redis.proc.pid) - redis0) / max(1, total) * 1e6))
                result[f"c{c}"] = {name: {"gateway_cpu_us": round(statistics.median(r[0] for r in rs), 1),
                                          "p50_ms": round(statistics.median(r[1] for r in rs), 3),
                                          "rps": round(statistics.median(r[2] for r in rs)),
                                          "errors": sum(r[3] for r in rs),
                                          "redis_cpu_us": round(statistics.median(r[4] for r in rs), 1)}
                                   for name, rs in rows.items()}
        finally:
            stop(procs)
            redis.stop()
    return result


def report(result: dict) -> str:
    lines = [f"{result['gateways']} gateways, {result['engines']} engines; a request charges "
             f"{result['token_charge']} tokens", "",
             "| gateways | tenant | offered | admitted/s | allowed/s | admitted / allowed | refused |",
             "|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        mode = "sharing Redis" if r["shared"] else "each alone"
        for name, t in r["tenants"].items():
            refused = ", ".join(f"{k}: {v}" for k, v in t["by_status"].items() if k != "200") or "-"
            lines.append(f"| {mode} | {name} | {t['offered']} | {t['admitted_per_s']} | {t.get('allowed_per_s', '-')} "
                         f"| {t.get('admitted_over_allowed', '-')} | {refused} |")
    lines.append("")
    for r in result["runs"]:
        redis = f", redis-server {r['redis_cpu_cores']} cores" if r["shared"] else ""
        lines.append(f"{'sharing Redis' if r['shared'] else 'each alone'}: {r['requests']} requests in "
                     f"{r['seconds']} s; the gateways' CPU {r['gateways_cpu_cores']} cores{redis}")
    costs = result.get("cost")
    if costs and "missing" in costs:
        lines += ["", f"cost per request: missing {costs['missing']}"]
    elif costs:
        lines += ["", "What sharing costs one gateway per request (wrk, the overhead benchmark's request, a "
                  "limit never reached):", "",
                  "| conc. | gateway | CPU us/req | p50 ms | req/s | Redis CPU us/req | errors |",
                  "|---|---|---|---|---|---|---|"]
        for conc, by in costs.items():
            for name, r in by.items():
                lines.append(f"| {conc[1:]} | {name} | {r['gateway_cpu_us']:.0f} | {r['p50_ms']:.2f} | {r['rps']:,} | "
                             f"{r['redis_cpu_us']:.0f} | {r['errors']} |")
    return "\n".join(lines)


def main(gateways: int, engines: int, seconds: float, out: str | None, contention_s: float = 60.0,
         faults: bool = True, faults_only: bool = False) -> None:
    from bouncer.bench import gateways_contention, gateways_faults

    if faults_only:
        runs = [gateways_faults.run(mode) for mode in ("fail-open", "fail-closed")]
        print(gateways_faults.report(runs))
        if out:
            pathlib.Path(out).write_text(json.dumps(runs, indent=2))
            print(f"saved {out}")
        return
    result = run(gateways, engines, seconds)
    result["cost"] = cost()
    print(report(result))
    if contention_s > 0:
        result["contention"] = gateways_contention.run(duration_s=contention_s)
        print("\n" + gateways_contention.report(result["contention"]))
    if faults:
        result["faults"] = [gateways_faults.run(mode) for mode in ("fail-open", "fail-closed")]
        print("\n" + gateways_faults.report(result["faults"]))
    if out:
        pathlib.Path(out).write_text(json.dumps(result, indent=2))
        print(f"saved {out}")
