"""`bouncer bench gateways`, through faults: three gateways sharing a Redis while the Redis is
killed and comes back empty, then while one gateway is killed with streams running through it.

Real processes and time: a `redis-server` of its own, `bouncer engine` replicas, three `bouncer
serve` gateways sharing the Redis (`on_unavailable` as asked), and the official openai SDK with
its retries as the client. The client reaches the gateways as a Kubernetes Service spreads them:
each request to the next gateway in turn, and a gateway that refused a connection left out for a
while (its endpoint leaves the Service when its readiness probe fails; a proxy's passive health
check does the same on a reset connection). Two tenants:
`limited` (a shared rate limit, offered twice it, plain requests) and `top` (priority, no limit,
streaming long answers, so that some are mid-stream when a gateway dies).

The run, in phases: shared; Redis killed (SIGKILL) for `outage_s`; Redis started again, empty;
one gateway killed (SIGKILL). Every 0.05 s, from a process of its own, each live gateway's
/metrics is read: whether it
reaches Redis, how many other gateways' parts it holds, and how many requests the others have
in flight on the replicas as it sees them. What it reports:
- per phase and tenant, what became of every request: completed, refused (by code), a stream
  cut by the kill and retried (once, by the client, with the SDK's retry header) elsewhere,
  failed after the SDK's retries, or lost (no answer by the client's timeout);
- every attempt's 5xx other than the documented 503s (the SDK retries them out of sight, so each
  attempt is read in a response hook);
- the limited tenant's admitted rate against its limit in each phase (fail-open: each gateway
  its share of the limit while Redis is away; fail-closed: 503 `shared_state_unavailable`);
- how long after Redis came back every gateway shared again (reaching Redis and holding the
  other two's parts), and how long after the kill the survivors dropped the dead gateway's part
  (its requests on the replicas with it): both against `lease_s`.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import pathlib
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

from bouncer.bench.live import Processes
from bouncer.bench.loopback import RedisServer, free_port, wait_ok
from bouncer.config import key_digest
from bouncer.tokenizer import default_tokenizer_path

MODEL = "demo-llm"
GATEWAYS = 3
ENGINES = 2
LEASE_S = 3.0
LIMIT_RPS = 10.0  # the limited tenant's shared limit (requests/s, burst as many)
LIMITED_OFFERED_RPS = 2 * LIMIT_RPS
TOP_RPS = 4.0
# Each answer this long, about 2 s on engines at speed 1: a few streams run through the gateway
# when it is killed. (1,000 tokens at speed 4 made the client parse 4,000 chunks a second and fall
# seconds behind its schedule on this 2-core machine.)
TOP_TOKENS = 250
ENGINE_SPEED = 1.0
CLIENT_TIMEOUT_S = 30.0
# A gateway that refused or reset a connection is left out this long: as a Service keeps an
# endpoint out while its readiness probe fails (the killed one never returns in this run). With 5 s
# it was tried again after, and a request whose SDK retries had gone on 429s failed there.
EJECT_S = 60.0
RID = "x-bouncer-faults-request"
PHASES = ("shared", "redis down", "redis back", "gateway killed")


@dataclass(frozen=True)
class Faults:
    """When each fault comes, in seconds from the first request."""

    redis_down_at: float = 8.0
    outage_s: float = 10.0
    kill_after_s: float = 10.0  # after Redis came back
    end_after_s: float = 12.0  # after the kill

    @property
    def redis_back_at(self) -> float:
        return self.redis_down_at + self.outage_s

    @property
    def kill_at(self) -> float:
        return self.redis_back_at + self.kill_after_s

    @property
    def end_at(self) -> float:
        return self.kill_at + self.end_after_s

    def phase(self, t: float) -> str:
        bounds = (self.redis_down_at, self.redis_back_at, self.kill_at)
        return PHASES[sum(t >= b for b in bounds)]


@dataclass
class Sent:
    """One request of the run, as its client saw it."""

    rid: str
    tenant: str
    at: float  # seconds from the run's start, when it was sent
    late: float = 0.0  # how far behind its schedule the client sent it
    outcome: str = "lost"  # completed, refused, failed or lost (no answer by the client's timeout)
    code: str = ""
    cut: bool = False  # a stream cut by the gateway's death, then retried
    attempts: list[int] = field(default_factory=list)  # the status of each attempt that was answered


@dataclass
class Watch:
    """What each gateway's /metrics said, every 0.05 s: (t, gateway, Redis reached, peers held,
    requests it holds in flight, requests the others have in flight on the replicas)."""

    rows: list[tuple] = field(default_factory=list)


def _config(port: int, engines: list[str], redis_url: str, on_unavailable: str) -> dict:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "logging": {"level": "warning", "access_log": False},
        "recorder": {"enabled": False},
        "tenants": [
            {"name": "limited", "api_keys_sha256": [key_digest("limited")], "priority": 0,
             "rate_limit": {"requests_per_s": LIMIT_RPS, "request_burst": int(LIMIT_RPS)}},
            {"name": "top", "api_keys_sha256": [key_digest("top")], "priority": 10},
        ],
        "models": [{"name": MODEL, "engine": "vllm", "tokenizer": str(default_tokenizer_path()), "max_model_len": 4096,
                    "backends": [{"url": url, "name": f"e{i}"} for i, url in enumerate(engines)]}],
        "shared_state": {"url": redis_url, "key_prefix": "faults:", "lease_s": LEASE_S,
                         "on_unavailable": on_unavailable},
    }


def _spread(ports: list[int]):
    """The client's way to the gateways: each request to the next live one in turn."""
    import httpx2

    class Spread(httpx2.AsyncBaseTransport):
        def __init__(self) -> None:
            self.inner = httpx2.AsyncHTTPTransport()
            self.turn = 0
            self.ejected: dict[int, float] = {}

        async def handle_async_request(self, request):
            now = time.monotonic()
            live = [p for p in ports if self.ejected.get(p, 0.0) <= now] or ports
            port = live[self.turn % len(live)]
            self.turn += 1
            request.url = request.url.copy_with(port=port)
            try:
                return await self.inner.handle_async_request(request)
            except httpx2.TransportError:  # refused, or reset: a passive health check leaves it out
                self.ejected[port] = now + EJECT_S
                raise

        async def aclose(self) -> None:
            await self.inner.aclose()

    return Spread()


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _watch(urls: list[str], t0: float, end: float) -> list[tuple]:
    import httpx2

    rows: list[tuple] = []

    async def poll(http, i: int) -> None:
        try:
            text = (await http.get(urls[i] + "/metrics")).text
        except httpx2.HTTPError:  # a killed gateway refuses at once
            return
        rows.append((round(time.monotonic() - t0, 2), i, int(_metric(text, "bouncer_shared_state_up")),
                     int(_metric(text, "bouncer_shared_state_peers")),
                     int(_metric(text, "bouncer_inflight_requests")),
                     int(_metric(text, "bouncer_replica_inflight_elsewhere_requests"))))

    async with httpx2.AsyncClient(timeout=1.0) as http:
        while time.monotonic() - t0 < end:
            await asyncio.gather(*(poll(http, i) for i in range(len(urls))))
            await asyncio.sleep(0.05)
    return rows


def watch_process(urls: list[str], t0: float, end: float, out: str) -> None:
    """The watch, in a process of its own: the client's process parses thousands of streamed
    chunks a second, and polls made there ran up to half a second late (CLOCK_MONOTONIC is one
    clock for every process, so `t0` holds across)."""
    pathlib.Path(out).write_text(json.dumps(asyncio.run(_watch(urls, t0, end))))


async def _one(client, sent: Sent, stream: bool, retried: bool = False) -> None:
    import httpx2
    import openai

    headers = {RID: sent.rid}
    if retried:
        headers["x-stainless-retry-count"] = "1"
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Request {sent.rid}: tell me about the fleet."}]}
    streamed = False
    try:
        if stream:
            answer = await client.chat.completions.create(**body, max_tokens=TOP_TOKENS, stream=True,
                                                          extra_body={"eos_after": TOP_TOKENS}, extra_headers=headers)
            async for _ in answer:
                streamed = True
        else:
            await client.chat.completions.create(**body, max_tokens=16, extra_headers=headers)
        sent.outcome, sent.code = "completed", ""
    except openai.APIStatusError as exc:
        sent.outcome = "refused" if exc.status_code in (429, 503) else "failed"
        try:
            sent.code = exc.body.get("code") or str(exc.status_code)  # type: ignore[union-attr]
        except AttributeError:
            sent.code = str(exc.status_code)
    except openai.APITimeoutError:
        sent.outcome, sent.code = "lost", "client timeout"
    except (openai.APIError, httpx2.HTTPError, OSError) as exc:
        if streamed and not retried:  # its gateway died mid-stream: the client sends it again
            sent.cut = True
            return await _one(client, sent, stream, retried=True)
        sent.outcome, sent.code = "failed", type(exc).__name__


async def _drive(ports: list[int], urls: list[str], faults: Faults, redis: RedisServer,
                 gateways: list, watch: Watch, work: str) -> tuple[list[Sent], Counter, dict]:
    import openai

    attempts: Counter = Counter()  # (tenant, phase, status) of every attempt, the SDK's retries included
    by_rid: dict[str, Sent] = {}
    t0 = time.monotonic() + 0.5
    events: dict[str, float] = {}

    async def note(response) -> None:
        s = by_rid.get(response.request.headers.get(RID, ""))
        if s is not None:
            s.attempts.append(response.status_code)
            attempts[(s.tenant, faults.phase(time.monotonic() - t0), response.status_code)] += 1

    clients = {tenant: openai.AsyncOpenAI(
        base_url=f"http://127.0.0.1:{ports[0]}/v1", api_key=tenant, max_retries=2, timeout=CLIENT_TIMEOUT_S,
        http_client=openai.DefaultAsyncHttpx2Client(transport=_spread(ports), timeout=CLIENT_TIMEOUT_S,
                                                    event_hooks={"response": [note]}))
        for tenant in ("limited", "top")}
    sent: list[Sent] = []
    tasks: list[asyncio.Task] = []

    async def load(tenant: str, rate: float, stream: bool) -> None:
        n = 0
        while (at := n / rate) < faults.end_at:
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            now = time.monotonic() - t0
            s = Sent(f"{tenant}-{n}", tenant, now, max(0.0, now - at))
            by_rid[s.rid] = s
            sent.append(s)
            tasks.append(asyncio.create_task(_one(clients[tenant], s, stream)))
            n += 1

    async def faults_in_turn() -> None:
        await asyncio.sleep(max(0.0, t0 + faults.redis_down_at - time.monotonic()))
        events["redis_down"] = time.monotonic() - t0  # SIGKILL goes at once; the wait for its end follows
        await asyncio.to_thread(redis.stop)
        await asyncio.sleep(max(0.0, t0 + faults.redis_back_at - time.monotonic()))
        events["redis_back"] = time.monotonic() - t0  # started: counted from before it even answers
        await asyncio.to_thread(redis.start)  # the same port, empty
        await asyncio.sleep(max(0.0, t0 + faults.kill_at - time.monotonic()))
        gateways[-1].send_signal(signal.SIGKILL)
        events["killed"] = time.monotonic() - t0

    rows = pathlib.Path(work) / "watch.json"
    watcher = multiprocessing.get_context("spawn").Process(target=watch_process,
                                                           args=(urls, t0, faults.end_at + 2.0, str(rows)))
    watcher.start()
    await asyncio.gather(load("limited", LIMITED_OFFERED_RPS, False), load("top", TOP_RPS, True), faults_in_turn())
    await asyncio.to_thread(watcher.join, 30)
    watch.rows = [tuple(r) for r in json.loads(rows.read_text())]
    _, pending = await asyncio.wait(tasks, timeout=CLIENT_TIMEOUT_S + 5.0) if tasks else (set(), set())
    for task in pending:  # their Sent stays "lost"
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for client in clients.values():
        await client.close()
    return sent, attempts, events


def _settled(rows: list[tuple], since: float, until: float, gateways: range, ok) -> float | None:
    """When every gateway of `gateways` read `ok(up, peers)` at its every poll from then until
    `until`: the first poll after each one's last that did not, the latest over them; None if
    one never settled."""
    settled = []
    for g in gateways:
        mine = [(t, ok(up, peers)) for t, gg, up, peers, *_ in rows if gg == g and since <= t < until]
        bad = [t for t, good in mine if not good]
        after = [t for t, _ in mine if t > (bad[-1] if bad else -1.0)]
        if not after:
            return None
        settled.append(after[0])
    return max(settled)


def _summary(sent: list[Sent], attempts: Counter, events: dict, watch: Watch, faults: Faults) -> dict:
    phases: dict = {}
    for phase in PHASES:
        lo = {"shared": 0.0, "redis down": events["redis_down"], "redis back": events["redis_back"],
              "gateway killed": events["killed"]}[phase]
        hi = {"shared": events["redis_down"], "redis down": events["redis_back"], "redis back": events["killed"],
              "gateway killed": faults.end_at}[phase]
        by_tenant = {}
        for tenant in ("limited", "top"):
            mine = [s for s in sent if s.tenant == tenant and lo <= s.at < hi]
            outcomes = Counter(f"{s.outcome} {s.code}" if s.code else s.outcome for s in mine)
            row = {"offered": len(mine), "outcomes": dict(outcomes.most_common()),
                   "streams_cut_then_retried": sum(s.cut for s in mine),
                   "attempts_by_status": {str(k[2]): n for k, n in sorted(attempts.items())
                                          if k[0] == tenant and k[1] == phase}}
            if tenant == "limited" and hi > lo:
                row["admitted_per_s"] = round(outcomes.get("completed", 0) / (hi - lo), 2)
            by_tenant[tenant] = row
        phases[phase] = {"from_s": round(lo, 2), "to_s": round(hi, 2), "tenants": by_tenant}
    shared_again = _settled(watch.rows, events["redis_back"], events["killed"], range(GATEWAYS),
                            lambda up, peers: up == 1 and peers == GATEWAYS - 1)
    # the survivors hold one another's part and no longer the dead one's
    released = _settled(watch.rows, events["killed"], float("inf"), range(GATEWAYS - 1),
                        lambda up, peers: peers == GATEWAYS - 2)
    dead = [r[4] for r in watch.rows if r[1] == GATEWAYS - 1 and r[0] < events["killed"]]
    errors_5xx = sum(n for (_, _, status), n in attempts.items() if status >= 500 and status != 503)
    return {"events_s": {k: round(v, 2) for k, v in events.items()}, "phases": phases,
            "attempts_5xx_not_503": errors_5xx,
            "lost": sum(s.outcome == "lost" for s in sent),
            "client_late_s_max": round(max((s.late for s in sent), default=0.0), 3),
            # what each request that failed was answered before (the SDK's retries spent on 429s, say)
            "failed": [{"rid": s.rid, "sent_s": round(s.at, 2), "error": s.code, "answered_attempts": s.attempts}
                       for s in sent if s.outcome == "failed"],
            "shared_again_s_after_redis_back": None if shared_again is None
            else round(shared_again - events["redis_back"], 2),
            "dead_gateway_dropped_s_after_kill": None if released is None else round(released - events["killed"], 2),
            "killed_gateway_inflight_at_last_poll": dead[-1] if dead else None,
            "watch": watch.rows}


def run(on_unavailable: str = "fail-open", faults: Faults = Faults()) -> dict:
    """One run through every fault; `on_unavailable` as in `shared_state`."""
    with tempfile.TemporaryDirectory(prefix="bouncer-faults-") as work:
        procs = Processes(pathlib.Path(work))
        redis = RedisServer()
        try:
            engines = []
            for i in range(ENGINES):
                port = free_port()
                procs.start(f"engine-{i}", ["engine", "--port", str(port), "--model", MODEL, "--speed",
                                                     str(ENGINE_SPEED)])
                engines.append(f"http://127.0.0.1:{port}")
            for url in engines:
                wait_ok(url + "/health")
            ports = [free_port() for _ in range(GATEWAYS)]
            gateways, urls = [], []
            for i, port in enumerate(ports):
                path = pathlib.Path(work) / f"gateway-{i}.json"
                path.write_text(json.dumps(_config(port, engines, redis.url, on_unavailable)))
                gateways.append(procs.start(f"gateway-{i}", ["serve", "--config", str(path)]))
                urls.append(f"http://127.0.0.1:{port}")
            for url in urls:
                wait_ok(url + "/ready", timeout=60)
            time.sleep(1.0)  # they have counted each other and read each other's parts
            watch = Watch()
            sent, attempts, events = asyncio.run(_drive(ports, urls, faults, redis, gateways, watch, work))
        finally:
            procs.stop()
            redis.stop()
    return {"on_unavailable": on_unavailable, "gateways": GATEWAYS, "engines": ENGINES, "lease_s": LEASE_S,
            "limit_rps": LIMIT_RPS, "faults": {"redis_down_at": faults.redis_down_at, "outage_s": faults.outage_s,
                                               "kill_at": faults.kill_at, "end_at": faults.end_at},
            **_summary(sent, attempts, events, watch, faults)}


def report(runs: list[dict]) -> str:
    lines = []
    for r in runs:
        lines += [f"Faults, {r['gateways']} gateways sharing Redis ({r['on_unavailable']}, lease {r['lease_s']:g} s), "
                  f"{r['engines']} engines; limited: {r['limit_rps']:g} req/s shared, offered twice that; top: "
                  "streams", "",
                  "| phase | tenant | offered | outcomes | streams cut, retried | admitted/s |",
                  "|---|---|---|---|---|---|"]
        for phase, p in r["phases"].items():
            for tenant, t in p["tenants"].items():
                outcomes = ", ".join(f"{k}: {v}" for k, v in t["outcomes"].items())
                lines.append(f"| {phase} ({p['from_s']:g}-{p['to_s']:g} s) | {tenant} | {t['offered']} | {outcomes} | "
                             f"{t['streams_cut_then_retried']} | {t.get('admitted_per_s', '-')} |")
        lines += ["", f"5xx attempts other than 503: {r['attempts_5xx_not_503']}; requests lost: {r['lost']}; "
                  f"the client at most {r['client_late_s_max']} s behind its schedule; "
                  f"every gateway sharing again {r['shared_again_s_after_redis_back']} s after Redis was started; "
                  f"the killed gateway's part dropped by both survivors {r['dead_gateway_dropped_s_after_kill']} s "
                  f"after the kill (lease {r['lease_s']:g} s), which held {r['killed_gateway_inflight_at_last_poll']} "
                  "requests in flight at its last poll",
                  *(f"failed: {f['rid']} sent at {f['sent_s']} s, {f['error']} after attempts answered "
                    f"{f['answered_attempts'] or 'none'}" for f in r["failed"]),
                  ""]
    return "\n".join(lines)

