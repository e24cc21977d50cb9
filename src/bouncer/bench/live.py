"""`bouncer bench live`: Bouncer in real time, beside the same traffic sent straight to the
engines and beside the simulator's prediction of both.

One run starts `engines` `bouncer engine` processes (a profile run at `speed`, with its KV pool
and batch size), then a `bouncer serve` process with a scenario's tenants in front of them, and
replays the scenario's requests in real time as the simulator would generate them (the same
trace, rate, duration and seed: open loop, each request at its arrival time) through the
official openai SDK with its default retries: what a user's client does with a 429 or a 503.
Each request is sent with the trace's prompt length (as token ids, prefixes shared where the
trace shares them) and its output length (`eos_after`, the engine model's field: the gateway
sees only the tenant's `max_tokens`, as with a real model). Then the same requests go straight
to the engines, round-robin, with no admission. Then the simulator runs both on the same
profile, scaled to the engines' speed: `bouncer` and `none`.

Goodput is counted as the client sees it (TTFT from the first attempt's send, TPOT from the
stream), with the simulator's rule (`bouncer.bench.goodput.within_slo`), per tenant.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass

import yaml

from bouncer.bench import envoy_peers, guidellm
from bouncer.bench.goodput import (
    BOUNCER_POLICY,
    engine_profile,
    fleet_capacity,
    fleet_config,
    make_policy,
    tenant_configs,
    tenant_outcomes,
)
from bouncer.bench.loopback import free_port, wait_ok
from bouncer.config import key_digest, parse_config
from bouncer.gateway.fronts.envoy_bootstrap import bootstrap
from bouncer.sim import scenarios
from bouncer.sim.fleet import FleetSim, SimRequest
from bouncer.sim.policies import SIM_MODEL
from bouncer.sim.profiles import DEFAULT_PROFILE, EngineProfile
from bouncer.sim.scenarios import FLOOD_OUTPUT, FLOOD_PROMPT, Scenario, get_scenario
from bouncer.sim.workloads import TenantSpec, make_requests
from bouncer.tokenizer import default_tokenizer_path

ADMIN_KEY = "live-admin"
RID_HEADER = "x-bouncer-live-request"  # which of the run's requests an attempt is, for counting its refusals
DRAIN_S = 90.0  # after the last arrival, how long requests still running may take before they are cut
TOKEN_IDS = (100, 2000)  # prompt token ids are drawn from these, within the bundled tokenizer's 2,048


@dataclass(frozen=True)
class LiveFleet:
    """The engines a live run starts."""

    engines: int = 2
    profile: str = DEFAULT_PROFILE
    speed: float = 0.25  # `bouncer engine --speed`: its clock runs this many times as fast as real time
    kv_blocks: int = 2048
    max_num_seqs: int = 64

    def sim_profile(self) -> EngineProfile:
        """The profile as these engines run it: every time `1 / speed` as long, their pool and batch."""
        p, s = engine_profile(self.profile), self.speed
        return dataclasses.replace(p, name=f"{p.name}@{s:g}x-{self.kv_blocks}b-{self.max_num_seqs}s",
                                   a=p.a / s, b=p.b / s, c=p.c / s, d=p.d / s, pcie_bytes_per_s=p.pcie_bytes_per_s * s,
                                   num_blocks=self.kv_blocks, max_num_seqs=self.max_num_seqs)


# -- processes ---------------------------------------------------------------------------------------


class Processes:
    """The engines and the gateway of one run, each its own process; all stopped on exit."""

    def __init__(self, work: pathlib.Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop)
        self.logs.append(log)
        proc = subprocess.Popen([sys.executable, "-m", "bouncer", *args], stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def engines(self, fleet: LiveFleet) -> list[str]:
        urls = []
        for i in range(fleet.engines):
            port = free_port()
            self.start(f"engine-{i}", ["engine", "--port", str(port), "--model", SIM_MODEL, "--profile", fleet.profile,
                                       "--speed", str(fleet.speed), "--kv-blocks", str(fleet.kv_blocks),
                                       "--max-num-seqs", str(fleet.max_num_seqs), "--seed", str(i)])
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_ok(url + "/health")
        return urls

    def gateway(self, config: dict, name: str = "gateway") -> str:
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        port = config["listen"]["port"]
        self.start(name, ["serve", "--config", str(path), "--log-level", "warning"])
        url = f"http://127.0.0.1:{port}"
        wait_ok(url + "/ready", timeout=60)
        return url

    def picker(self, config: dict, name: str = "picker") -> tuple[str, str]:
        """`bouncer serve --mode epp` on `config` and an Envoy in front of it
        (`bouncer envoy-config`'s bootstrap): the URL clients use (Envoy's), and the picker's
        HTTP port (its /admin)."""
        binary = envoy_peers.envoy_binary()
        if binary is None:
            raise RuntimeError(f"no Envoy: {envoy_peers.INSTALL}")
        config = {**config, "picker": {"host": "127.0.0.1", "port": free_port()}}
        path = self.work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.start(name, ["serve", "--mode", "epp", "--config", str(path), "--log-level", "warning"])
        admin = f"http://127.0.0.1:{config['listen']['port']}"
        wait_ok(admin + "/ready", timeout=60)
        port = free_port()
        envoy_yaml = self.work / f"{name}-envoy.yaml"
        envoy_yaml.write_text(yaml.safe_dump(bootstrap(parse_config(config), listen_port=port, admin_port=None)))
        log = open(self.work / f"{name}-envoy.log", "ab")  # noqa: SIM115 (closed in stop)
        self.logs.append(log)
        self.procs.append(subprocess.Popen([binary, "-c", str(envoy_yaml), "--use-dynamic-base-id", "--log-level",
                                            "error"], stdout=log, stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{port}"
        wait_ok(url + "/v1/models", timeout=60)
        return url, admin

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        self.procs.clear()
        for log in self.logs:
            log.close()
        self.logs.clear()


def gateway_config(scenario, fleet: LiveFleet, engines: list[str], step_time: dict, port: int) -> dict:
    """The simulator's Bouncer (`make_policy`'s config: the scenario's tenants, the shipped
    policy) in front of the live engines; a tenant's API key is its name."""
    prof = fleet.sim_profile()
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin_keys_sha256": [key_digest(ADMIN_KEY)],
        "tenants": tenant_configs(scenario),
        "models": [{"name": SIM_MODEL, "max_model_len": scenario.max_model_len, "block_size": prof.block_size,
                    "step_time": step_time,
                    "backends": [{"url": url, "name": f"r{i}", "kv_blocks": fleet.kv_blocks}
                                 for i, url in enumerate(engines)]}],
        "policy": BOUNCER_POLICY,
        "logging": {"access_log": False},
    }


def step_time_config(fleet: LiveFleet, mode: str) -> dict:
    """`given`: the profile's coefficients scaled to the engines' speed, as an operator who had
    measured them would state them; `learned`: only the engines' token budget."""
    prof = fleet.sim_profile()
    if mode == "given":
        return prof.step_time_config
    if mode == "learned":
        return {"mode": "learned", "max_batched_tokens": prof.max_num_batched_tokens}
    raise ValueError(f"unknown step time {mode!r}: given or learned")


# -- the client --------------------------------------------------------------------------------------
def prompt_ids(req: SimRequest, block_size: int) -> list[int]:
    """`req.prompt_len` token ids; each block the trace marks shared (its digests) has the same
    ids wherever it appears, so the engines' prefix caches hit as the simulator's do."""
    lo, hi = TOKEN_IDS
    ids: list[int] = []
    for digest in req.block_digests:
        rng = random.Random(digest)
        ids += [rng.randrange(lo, hi) for _ in range(block_size)]
    rng = random.Random(req.rid)
    ids = ids[:req.prompt_len]
    ids += [rng.randrange(lo, hi) for _ in range(req.prompt_len - len(ids))]
    return ids


async def _one(client, req: SimRequest, ids: list[int], t0: float) -> None:
    """Send `req` at its arrival (relative to `t0`) and write what the client saw into it:
    first token and end in seconds from `t0`, outcome, tokens."""
    import openai

    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + req.arrival - loop.time()))
    tokens = 0
    try:
        stream = await client.completions.create(
            model=SIM_MODEL, prompt=ids, max_tokens=req.max_tokens, stream=True,
            stream_options={"include_usage": True}, extra_body={"eos_after": req.output_len},
            extra_headers={RID_HEADER: req.rid})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                if req.first_token_at is None:
                    req.first_token_at = loop.time() - t0
                tokens += 1
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        req.finished_at = loop.time() - t0
        req.outcome = "completed" if req.first_token_at is not None else "failed"
        req.output_len = tokens
    except openai.APIStatusError as exc:
        req.finished_at, req.outcome = loop.time() - t0, "refused" if exc.status_code in (429, 503, 529) else "failed"
        req.reason = _reason(exc)
    except (TimeoutError, openai.APIError) as exc:
        req.finished_at, req.outcome, req.reason = loop.time() - t0, "failed", type(exc).__name__


def _reason(exc) -> str:
    try:
        return exc.body.get("code") or str(exc.status_code)  # type: ignore[union-attr]
    except AttributeError:
        return str(exc.status_code)


async def _replay(requests: list[SimRequest], route, block_size: int) -> Counter:
    """Every request at its arrival time; `route(i, req)` is (base url, api key) for the i-th.
    Returns the refusals of every attempt, by tenant and reason (the SDK retries out of sight)."""
    import openai

    tenant_of = {r.rid: r.tenant for r in requests}
    refusals: Counter = Counter()

    async def note(response) -> None:  # an httpx2.Response: the openai SDK's HTTP client
        if response.status_code != 200:
            await response.aread()
            try:
                code = response.json()["error"].get("code")
            except (ValueError, KeyError, TypeError, AttributeError):
                code = None
            refusals[(tenant_of.get(response.request.headers.get(RID_HEADER, ""), "?"),
                      f"{response.status_code}/{code or '-'}")] += 1

    clients: dict[tuple[str, str], openai.AsyncOpenAI] = {}
    loop = asyncio.get_running_loop()
    t0 = loop.time() + 1.0  # a second to set up the tasks before the first arrival
    tasks = []
    for i, req in enumerate(requests):
        base, key = route(i, req)
        client = clients.get((base, key))
        if client is None:
            client = clients[(base, key)] = openai.AsyncOpenAI(
                base_url=base + "/v1", api_key=key, max_retries=req.max_retries, timeout=req.timeout_s,
                http_client=openai.DefaultAsyncHttpx2Client(event_hooks={"response": [note]}, timeout=req.timeout_s))
        tasks.append(asyncio.create_task(_one(client, req, prompt_ids(req, block_size), t0)))
    last = max((r.arrival for r in requests), default=0.0)
    _, pending = await asyncio.wait(tasks, timeout=last + 1.0 + DRAIN_S)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for req in requests:
        if req.outcome is None:
            req.outcome, req.reason = "abandoned", "run_ended"
    for client in clients.values():
        await client.close()
    return refusals


def replay(requests: list[SimRequest], route, block_size: int) -> tuple[list[SimRequest], Counter]:
    """A copy of `requests`, sent live, with what the client saw; and every attempt's refusal
    by (tenant, status/code)."""
    live = [dataclasses.replace(r, first_token_at=None, finished_at=None, outcome=None, reason=None)
            for r in requests]
    refusals = asyncio.run(_replay(live, route, block_size))
    return live, refusals


def _with_attempts(table: dict, refusals: Counter) -> dict:
    for (tenant, reason), n in refusals.items():
        t = table["tenants"].get(tenant)
        if t is not None:
            t.setdefault("attempts_refused", {})[reason] = n
    return table


def through_gateway(gateway: str):
    """Each request to the gateway, with its tenant's key (its name)."""
    return lambda i, req: (gateway, req.tenant)


def round_robin(engines: list[str]):
    """Each request straight to an engine, in turn: no admission."""
    return lambda i, req: (engines[i % len(engines)], "none")


# -- one run -----------------------------------------------------------------------------------------
def _state(gateway: str) -> dict:
    req = urllib.request.Request(gateway + "/admin/state", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _table(scenario, requests: list[SimRequest], duration_s: float, cut_at: float | None = None,
           warm_up_s: float = 0.0) -> dict:
    """Per tenant: what became of the requests that arrived after `warm_up_s` and before
    `duration_s`. With `cut_at`, one not finished by then counts as cut off (guidellm stops at its
    duration, and cuts what is still running)."""
    requests = [r for r in requests if warm_up_s <= r.arrival < duration_s]
    counted_s = duration_s - warm_up_s
    if cut_at is not None:
        requests = [dataclasses.replace(r, outcome="abandoned", reason="run_ended")
                    if r.outcome == "completed" and r.finished_at > cut_at else r for r in requests]
    out = {}
    for spec in scenario.tenants:
        mine = [r for r in requests if r.tenant == spec.name]
        t = tenant_outcomes(spec, mine)
        good = round((t["slo_attainment"] or 0.0) * t["offered"])
        out[spec.name] = {**t, "within_slo": good, "goodput_rps": good / counted_s,
                          "outcomes": dict(Counter(r.outcome for r in mine).most_common()),
                          "not_completed_by_reason": dict(Counter(f"{r.outcome}/{r.reason}" for r in mine
                                                                  if r.outcome != "completed").most_common())}
    total = sum(t["within_slo"] for t in out.values())
    return {"goodput_rps": total / counted_s, "tenants": out}


def _header(scenario: str, load: float, duration_s: float, fleet: LiveFleet, seed: int, step_time: str,
            capacity: float, offered: int) -> dict:
    return {"scenario": scenario, "load": load, "duration_s": duration_s, "seed": seed,
            "fleet": dataclasses.asdict(fleet), "step_time": step_time, "capacity_rps": capacity,
            "offered": offered, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}


def _simulated(result: dict, scenario: Scenario, requests: list[SimRequest], fleet: LiveFleet, seed: int,
               step_time: str, duration_s: float, cut_at: float | None = None, warm_up_s: float = 0.0) -> None:
    """The simulator's run of the same requests on the same engines, Bouncer and none: first,
    as it takes seconds and says what to expect."""
    for policy in ("bouncer", "none"):
        cfg = fleet_config(policy, fleet.engines, fleet.sim_profile(), seed, scenario)
        gw = make_policy(policy, scenario, cfg, step_time=step_time)
        simulated = copy.deepcopy(requests)
        FleetSim(cfg, gw, gw.replica_names).run(simulated)
        result[f"sim_{policy}"] = _table(scenario, simulated, duration_s, cut_at, warm_up_s)


def run(scenario_name: str, load: float, duration_s: float = 60.0, fleet: LiveFleet = LiveFleet(), seed: int = 0,
        step_time: str = "learned", trace: str | None = None, skip_direct: bool = False,
        warm_up_s: float = 0.0) -> dict:
    """The scenario's requests replayed open loop (module doc). Only those arriving after
    `warm_up_s` are counted: the learned step time's promise is for a gateway that has seen
    traffic (all requests are still sent, so the engines and the fit see the warm-up)."""
    if not 0 <= warm_up_s < duration_s:
        raise ValueError(f"the warm-up ({warm_up_s:g} s) must be shorter than the run ({duration_s:g} s)")
    scenario = get_scenario(scenario_name, duration_s)
    traces = scenario.load(trace)
    prof = fleet.sim_profile()
    capacity = fleet_capacity(scenario, traces, fleet.engines, prof, seed, trace)
    requests = make_requests(scenario.tenants, traces, load * capacity, duration_s, seed)
    result = _header(scenario.name, load, duration_s, fleet, seed, step_time, capacity, len(requests))
    result["warm_up_s"] = warm_up_s
    _simulated(result, scenario, requests, fleet, seed, step_time, duration_s, warm_up_s=warm_up_s)
    with tempfile.TemporaryDirectory(prefix="bouncer-live-") as work:
        procs = Processes(pathlib.Path(work))
        try:
            engines = procs.engines(fleet)
            gateway = procs.gateway(gateway_config(scenario, fleet, engines, step_time_config(fleet, step_time),
                                                   free_port()))
            started = time.monotonic()
            live, refusals = replay(requests, through_gateway(gateway), prof.block_size)
            result["live_bouncer"] = {**_with_attempts(_table(scenario, live, duration_s, warm_up_s=warm_up_s),
                                                       refusals),
                                      "wall_s": time.monotonic() - started,
                                      "step_time": _state(gateway)["models"][SIM_MODEL]["step_time"]}
        finally:
            procs.stop()
        if not skip_direct:
            procs = Processes(pathlib.Path(work))
            try:
                engines = procs.engines(fleet)  # fresh engines: empty caches, as the gateway's run had
                live, refusals = replay(requests, round_robin(engines), prof.block_size)
                result["live_direct"] = _with_attempts(_table(scenario, live, duration_s, warm_up_s=warm_up_s),
                                                       refusals)
            finally:
                procs.stop()
    return result


# -- the flood: guidellm as a sheddable tenant, the openai SDK as the top one -------------------------
# the flood goes on this long past the run's duration, so that the requests counted (those that
# arrive within it) see the same load to their end, and have time to finish before guidellm stops
FLOOD_TAIL_S = 20.0
TOP_RATE = 1.0  # the top tenant's short streamed requests, one a second


def flood_scenario(flood_rate: float) -> tuple[Scenario, float]:
    """The flood run as the simulator sees it (`scenarios.flood`), the top tenant at TOP_RATE
    beside guidellm's `flood_rate`. Returns it and the total rate."""
    total = flood_rate + TOP_RATE
    return scenarios.flood(TOP_RATE / total), total


def flood_capacity(fleet: LiveFleet, seed: int) -> float:
    """What the engines complete of the flood's requests alone, per second (the simulator's
    closed-loop measure)."""
    scenario, _ = flood_scenario(1.0)
    scenario.tenants = [dataclasses.replace(scenario.tenants[1], share=1.0)]
    return fleet_capacity(scenario, scenario.loaded, fleet.engines, fleet.sim_profile(), seed, None)


def _flood_records(reqs: list[guidellm.GuidellmRequest], t0_wall: float, spec: TenantSpec) -> list[SimRequest]:
    """guidellm's requests as the simulator's records, in seconds from `t0_wall`."""
    out = []
    for i, g in enumerate(reqs):
        r = SimRequest(rid=f"flood-{i}", tenant="flood", priority=spec.priority, arrival=g.targeted_start - t0_wall,
                       prompt_len=FLOOD_PROMPT, output_len=g.output_tokens, max_tokens=FLOOD_OUTPUT, block_digests=[],
                       ttft_slo=spec.ttft_slo, tpot_slo=spec.tpot_slo, timeout_s=spec.timeout_s, max_retries=0)
        done = g.status == "successful" and g.first_token is not None
        r.outcome = "completed" if done else "refused" if g.status == "errored" else "abandoned"
        r.reason = None if done else g.status
        if done:
            r.first_token_at, r.finished_at = g.first_token - t0_wall, g.end - t0_wall  # type: ignore[operator]
        out.append(r)
    return out


def run_flood(load: float, duration_s: float = 40.0, fleet: LiveFleet = LiveFleet(), seed: int = 0,
              step_time: str = "learned", guidellm_bin: str | None = None, skip_direct: bool = False,
              epp: bool = False) -> dict:
    """guidellm at `load` x the engines' capacity as the sheddable `flood` tenant, the top tenant
    beside it; live through Bouncer, live straight to the engines (round-robin), and simulated.
    `epp`: also live through Envoy with Bouncer as its endpoint picker (`bouncer_epp`)."""
    binary = pathlib.Path(guidellm_bin or os.environ.get("BOUNCER_GUIDELLM", ".venv-guidellm/bin/guidellm"))
    if not binary.exists():
        raise RuntimeError(f"no guidellm at {binary}: `make test` installs it in .venv-guidellm, or pass --guidellm")
    capacity = flood_capacity(fleet, seed)
    scenario, total = flood_scenario(load * capacity)
    run_s = duration_s + FLOOD_TAIL_S
    requests = make_requests(scenario.tenants, scenario.loaded, total, run_s, seed)
    prof = fleet.sim_profile()
    result = _header("flood", load, duration_s, fleet, seed, step_time, capacity,
                     sum(1 for r in requests if r.arrival < duration_s))
    result.update(driver="guidellm", tail_s=FLOOD_TAIL_S)
    _simulated(result, scenario, requests, fleet, seed, step_time, duration_s, cut_at=run_s)
    top = [r for r in requests if r.tenant == "top"]
    targets = ["bouncer", *(["bouncer_epp"] if epp else []), *([] if skip_direct else ["direct"])]
    with tempfile.TemporaryDirectory(prefix="bouncer-live-") as work:
        for target in targets:
            procs = Processes(pathlib.Path(work))
            try:
                engines = procs.engines(fleet)
                if target != "direct":
                    config = gateway_config(scenario, fleet, engines, step_time_config(fleet, step_time), free_port())
                    config["models"][0]["tokenizer"] = str(default_tokenizer_path())  # guidellm's prompts are text
                    if target == "bouncer":
                        gateway = procs.gateway(config)
                        flood_at, route = [gateway], through_gateway(gateway)
                    else:  # clients talk to Envoy; the picker's admin port says its state
                        envoy, gateway = procs.picker(config)
                        flood_at, route = [envoy], through_gateway(envoy)
                else:
                    flood_at, route = engines, round_robin(engines)
                records, refusals = _drive_flood(flood_at, engines, route, top, load * capacity, run_s, binary,
                                       pathlib.Path(work) / target, scenario.tenants[1], prof.block_size)
                table = _with_attempts(_table(scenario, records, duration_s, cut_at=run_s), refusals)
                if target != "direct":
                    table["step_time"] = _state(gateway)["models"][SIM_MODEL]["step_time"]
                result[f"live_{target}"] = table
            finally:
                procs.stop()
    return result


def _drive_flood(flood_at: list[str], engines: list[str], route, top: list[SimRequest], rate: float,
                 duration_s: float, binary: pathlib.Path, work: pathlib.Path, flood_spec: TenantSpec,
                 block_size: int) -> tuple[list[SimRequest], Counter]:
    """guidellm against `flood_at` (split evenly when direct: one guidellm per engine, as
    round-robin would), the top tenant's requests through `route`, at once."""
    import threading

    runs: list[guidellm.GuidellmRun] = []
    errors: list[BaseException] = []

    def flood(i: int, target: str) -> None:
        try:
            runs.append(guidellm.run(binary, target, SIM_MODEL, "flood", rate / len(flood_at), duration_s,
                                     FLOOD_PROMPT, FLOOD_OUTPUT, work / f"guidellm-{i}"))
        except BaseException as exc:  # noqa: BLE001 (reported below, after the top tenant's requests end)
            errors.append(exc)

    threads = [threading.Thread(target=flood, args=(i, t)) for i, t in enumerate(flood_at)]
    for t in threads:
        t.start()
    _until_engines_see_traffic(engines)  # guidellm takes seconds to start: the top tenant starts with the flood
    live_top, refusals = replay(top, route, block_size)
    for t in threads:
        t.join(duration_s + 300)
    if errors:
        raise errors[0]
    flood = [g for run in runs for g in guidellm.requests(run.report)]
    t0 = min((g.targeted_start for g in flood), default=0.0)
    return live_top + _flood_records(flood, t0, flood_spec), refusals


def _until_engines_see_traffic(engines: list[str], timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for url in engines:
            with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
                for line in resp.read().decode().splitlines():
                    if line.startswith("vllm:prompt_tokens_total") and float(line.split()[-1]) > 0:
                        return
        time.sleep(0.05)
    raise RuntimeError(f"no request reached the engines in {timeout_s:g} s")


COLUMNS = (("live_bouncer", "live Bouncer"), ("live_bouncer_epp", "live Envoy + Bouncer picker"),
           ("live_direct", "live direct"), ("sim_bouncer", "sim Bouncer"),
           ("sim_none", "sim none"))


def report(result: dict) -> str:
    cols = [(k, title) for k, title in COLUMNS if k in result]
    lines = [f"{result['scenario']} at load {result['load']:g} ({result['capacity_rps']:.2f} req/s capacity, "
             f"{result['offered']} requests over {result['duration_s']:g} s; {result['fleet']['engines']} engines "
             f"{result['fleet']['profile']} at {result['fleet']['speed']:g}x; step time {result['step_time']}"
             + (f"; counted after {result['warm_up_s']:g} s" if result.get("warm_up_s") else "") + ")",
             "goodput req/s (SLO attainment, TTFT p99):"]
    lines.append(f"  {'tenant':>12}  " + "  ".join(f"{title:>26}" for _, title in cols))
    tenants = list(result[cols[0][0]]["tenants"])
    for name in [*tenants, "all"]:
        cells = []
        for key, _ in cols:
            if name == "all":
                cells.append(f"{result[key]['goodput_rps']:26.2f}")
                continue
            t = result[key]["tenants"][name]
            p99 = "-" if t["ttft_p99_s"] is None else f"{t['ttft_p99_s']:.2f}s"
            att = "-" if t["slo_attainment"] is None else f"{t['slo_attainment']:.1%}"
            cells.append(f"{t['goodput_rps']:8.2f} ({att:>6}, {p99:>6})".rjust(26))
        lines.append(f"  {name:>12}  " + "  ".join(cells))
    if "live_bouncer" in result and "sim_bouncer" in result:
        live, sim = result["live_bouncer"]["goodput_rps"], result["sim_bouncer"]["goodput_rps"]
        lines.append(f"  live / simulated Bouncer goodput: {live / sim:.2f}" if sim else "")
    return "\n".join(lines)
