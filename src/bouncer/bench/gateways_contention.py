"""`bouncer bench gateways`, under contention: one saturated fleet through one gateway, three
independent gateways, and three sharing a Redis, with each tenant on its own gateway.

Real processes and time: `bouncer engine` replicas (a profile at `speed`, as `bench live` runs
them), `bouncer serve` gateways on one config (the simulator's Bouncer config for the `gateways`
scenario: `top`, band 10 with a 1 s TTFT SLO; `steady` and `bursty`, band 0 of equal weight,
`bursty` 10x through the middle third), a `redis-server` of its own for the shared run, and the
official openai SDK with its retries replaying the scenario open loop (`bench live`'s client).
As a load balancer that keeps each client's connection on one gateway would place them: `top`
on gateway 0, `steady` on gateway 1, `bursty` on gateway 2. What it measures, per setup: goodput,
the top band's SLO attainment, and the two same-band tenants' shares of the tokens served while
the burst runs (equal weights: half each is fair, while both want more than half).
"""

from __future__ import annotations

import pathlib
import re
import tempfile
import time
import urllib.request

from bouncer.bench.goodput import fleet_capacity, tokens_served
from bouncer.bench.live import (
    LiveFleet,
    Processes,
    _header,
    _table,
    _with_attempts,
    gateway_config,
    replay,
    step_time_config,
)
from bouncer.bench.loopback import RedisServer, free_port
from bouncer.sim.fleet import SimRequest
from bouncer.sim.scenarios import get_scenario
from bouncer.sim.workloads import make_requests

SETUPS = (("one gateway", 1, False), ("3 independent", 3, False), ("3 sharing Redis", 3, True))
PLACEMENT = ("top", "steady", "bursty")  # tenant i on gateway i mod N
# Two engines, at twice their capacity: on this project's 2-core machine, four engines at that load
# (the burst alone some 70 req/s) saturate the client and the gateways themselves, and the run
# then measures the machine (one gateway kept 46% of the top band's SLO).
FLEET = LiveFleet(engines=2)
LOAD = 2.0


def band_shares(requests: list[SimRequest], tenants: tuple[str, ...], lo: float, hi: float) -> dict[str, float]:
    """Each of the named tenants' share of the tokens they were served within [lo, hi)."""
    served = tokens_served(requests, lo, hi)
    total = sum(served.get(t, 0.0) for t in tenants) or 1.0
    return {t: round(served.get(t, 0.0) / total, 4) for t in tenants}


def _gateways(procs: Processes, n: int, config: dict, redis: RedisServer | None) -> list[str]:
    urls = []
    for i in range(n):
        port = free_port()
        cfg = {**config, "listen": {**config["listen"], "port": port}}
        if redis is not None:
            cfg["shared_state"] = {"url": redis.url, "key_prefix": "contention:"}
        urls.append(procs.gateway(cfg, name=f"gateway-{i}"))
    if redis is not None:
        time.sleep(1.0)  # they have counted each other and read each other's parts
    return urls


def run(load: float = LOAD, duration_s: float = 60.0, fleet: LiveFleet = FLEET, seed: int = 0,
        step_time: str = "given") -> dict:
    scenario = get_scenario("gateways", duration_s)
    traces = scenario.load(None)
    prof = fleet.sim_profile()
    capacity = fleet_capacity(scenario, traces, fleet.engines, prof, seed, None)
    requests = make_requests(scenario.tenants, traces, load * capacity, duration_s, seed)
    result = _header(scenario.name, load, duration_s, fleet, seed, step_time, capacity, len(requests))
    lo, hi = (f * duration_s for f in scenario.contention_window)
    result["runs"] = []
    with tempfile.TemporaryDirectory(prefix="bouncer-gateways-") as work:
        for label, n, shared in SETUPS:
            procs = Processes(pathlib.Path(work))
            redis = RedisServer() if shared else None
            try:
                engines = procs.engines(fleet)  # fresh engines each time: empty caches
                config = gateway_config(scenario, fleet, engines, step_time_config(fleet, step_time), 0)
                config["logging"] = {"level": "warning", "access_log": False}
                urls = _gateways(procs, n, config, redis)
                home = {tenant: urls[i % n] for i, tenant in enumerate(PLACEMENT)}
                started = time.monotonic()
                route = lambda i, req, home=home: (home[req.tenant], req.tenant)  # noqa: E731 (its key: its name)
                live, refusals = replay(requests, route, prof.block_size)
                table = _with_attempts(_table(scenario, live, duration_s), refusals)
                claims = _claims(urls) if shared else None
            finally:
                procs.stop()
                if redis is not None:
                    redis.stop()
            result["runs"].append({"setup": label, "gateways": n, "shared": shared,
                                   "wall_s": round(time.monotonic() - started, 1), **table,
                                   "band0_token_shares": band_shares(live, ("steady", "bursty"), lo, hi),
                                   "claims": claims})
    return result


def _claims(urls: list[str]) -> dict[str, int]:
    """The gateways' claims on nearly full replicas (`bouncer.core.sharing.claims`), held and refused, from
    their /metrics."""
    counts = {"held": 0, "refused": 0}
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for m in re.finditer(r'^bouncer_shared_state_claims_total\{result="(\w+)"\} ([\d.e+]+)$', text, re.M):
            counts[m.group(1)] = counts.get(m.group(1), 0) + int(float(m.group(2)))
    return counts


def report(result: dict) -> str:
    lines = [f"`gateways` scenario at load {result['load']:g} ({result['capacity_rps']:.1f} req/s capacity, "
             f"{result['fleet']['engines']} engines at speed {result['fleet']['speed']:g}), "
             f"{result['duration_s']:g} s; top on gateway 0, steady on 1, bursty on 2", "",
             "| gateways | goodput req/s | top SLO attainment | steady attainment | band-0 token shares during "
             "the burst (steady / bursty) |", "|---|---|---|---|---|"]
    for r in result["runs"]:
        t = r["tenants"]
        s = r["band0_token_shares"]
        lines.append(f"| {r['setup']} | {r['goodput_rps']:.2f} | {t['top']['slo_attainment']:.1%} | "
                     f"{t['steady']['slo_attainment']:.1%} | {s['steady']:.1%} / {s['bursty']:.1%} |")
    claimed = [(r["setup"], r["claims"]) for r in result["runs"] if r.get("claims")]
    if claimed:
        lines += ["", "Claims on nearly full replicas (held / refused): " + "; ".join(
            f"{setup}: {c['held']} / {c['refused']}" for setup, c in claimed)]
    return "\n".join(lines)

