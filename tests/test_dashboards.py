"""The Grafana dashboard and the Prometheus alert rules: valid files, the dashboard the
generator's output, and every query answered by a real Prometheus scraping the demo (so every
metric they name is one the demo exports)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import pathlib
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import openai
import pytest
import yaml

from bouncer.bench.loopback import RedisServer
from servers import free_port, poll_until, wait_http_ok

ROOT = pathlib.Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "bouncer.json"
RULES = ROOT / "deploy" / "prometheus" / "bouncer-alerts.yaml"
BOUNCER = str(pathlib.Path(sys.executable).with_name("bouncer"))
METRIC = re.compile(r"\b(bouncer_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
# exported only by a gateway with `shared_state` (the demo has none): checked against two gateways
# sharing a real redis-server instead
SHARED_ONLY = {"bouncer_shared_state_up", "bouncer_shared_state_gateways", "bouncer_shared_state_peers",
               "bouncer_shared_state_syncs_total", "bouncer_shared_state_failures_total",
               "bouncer_shared_state_refunds_lost_total", "bouncer_shared_state_claims_total"}
# exported only by a gateway with quotas and overflow targets (the demo has neither): checked
# against such a gateway, a real redis-server and a second engine as the overflow, instead
QUOTA_ONLY = {"bouncer_quota_spent", "bouncer_quota_remaining", "bouncer_overflow_requests_total"}
# served only for models whose replicas are found (discovery:), which the demo's are not
DISCOVERY_ONLY = {"bouncer_discovery_stale"}


def _tool(name: str) -> str:
    path = shutil.which(name) or f"/usr/bin/{name}"
    if not pathlib.Path(path).exists():
        pytest.fail(f"no {name}: `apt-get install prometheus` (make test does it as root)")
    return path


def dashboard_queries() -> list[str]:
    d = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in d["panels"] if p["type"] != "row" for t in p["targets"]]


def rule_queries() -> list[str]:
    return [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_the_dashboard_is_what_its_generator_writes():
    spec = importlib.util.spec_from_file_location("grafana_dashboard", ROOT / "scripts" / "grafana_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert DASHBOARD.read_text() == module.render(), "run scripts/grafana_dashboard.py and commit its output"


def test_the_dashboard_is_a_well_formed_grafana_model():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] and d["schemaVersion"] >= 36
    names = {v["name"] for v in d["templating"]["list"]}
    assert names == {"datasource", "model", "tenant"}
    for p in d["panels"]:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys() and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])
            assert p["datasource"]["uid"] == "${datasource}"
    panels = " ".join(p["title"] for p in d["panels"])
    for topic in ("Decisions", "Queue depth", "Queue wait", "Arrivals by band", "Arrivals by tenant", "SLO",
                  "saturation", "KV usage", "Telemetry age", "Permits"):
        assert topic in panels


def test_the_alert_rules_pass_promtool():
    out = subprocess.run([_tool("promtool"), "check", "rules", str(RULES)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 7 rules found" in out.stdout


def _query(prom: str, expr: str) -> dict:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read())


def _prometheus(tmp_path: pathlib.Path, jobs: dict[str, list[str]],
                rules: pathlib.Path | None = None) -> tuple[subprocess.Popen, str]:
    """A real Prometheus scraping `jobs` (name -> targets) every second, ready; and its URL."""
    prom_port = free_port()
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)] if rules else [],
        "scrape_configs": [{"job_name": name, "static_configs": [{"targets": targets}]}
                           for name, targets in jobs.items()]}))
    prom_log = tmp_path / "prometheus.log"
    with prom_log.open("wb") as log:
        prom = subprocess.Popen([_tool("prometheus"), f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    prom_url = f"http://127.0.0.1:{prom_port}"
    try:
        # (once, in CI, it was not ready within 30 s, with nothing to say why: its log is kept)
        wait_http_ok(prom_url + "/-/ready", timeout=90)
    except TimeoutError:
        prom.terminate()
        raise AssertionError(f"Prometheus not ready (exit code {prom.poll()}); its log ends:\n"
                             f"{prom_log.read_text(errors='replace')[-3000:]}") from None
    return prom, prom_url


def _unanswered(prom_url: str, queries: list[str]) -> list[str]:
    """The dashboard queries a Prometheus gives no series for (or an error)."""
    problems = []
    for expr in queries:
        concrete = expr.replace("$__rate_interval", "20s").replace("$tenant", ".*").replace("$model", ".*")
        answer = _query(prom_url, concrete)
        if answer["status"] != "success":
            problems.append(f"{expr}: {answer.get('error')}")
        elif not answer["data"]["result"]:
            problems.append(f"{expr}: no series")
    return problems


async def _traffic(base: str) -> None:
    """40 streamed requests per tenant, 8 at a time (every histogram gets samples, every band its
    TTFT margin, which needs 32 measured first tokens), and refused ones."""
    async def tenant(key: str, n: int) -> None:
        c = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)

        async def one(i: int) -> None:
            try:
                stream = await c.chat.completions.create(model="demo-llm", max_tokens=16, stream=True, messages=[
                    {"role": "user", "content": f"{key} question {i}: " + "why " * 50}])
                async for _chunk in stream:
                    pass
            except openai.APIStatusError:
                pass
        for start in range(0, n, 8):
            await asyncio.gather(*(one(i) for i in range(start, min(n, start + 8))))
    await asyncio.gather(tenant("demo-interactive", 40), tenant("demo-research", 40), tenant("demo-free", 40),
                         tenant("not-a-key", 2))


@pytest.mark.slow
def test_a_real_prometheus_scraping_the_demo_answers_every_query(tmp_path):
    port, engines = free_port(), (free_port(), free_port())
    demo = subprocess.Popen([BOUNCER, "serve", "--port", str(port), "--engine-ports", f"{engines[0]},{engines[1]}",
                             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prom = None
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http_ok(base + "/ready", timeout=30)
        prom, prom_url = _prometheus(tmp_path, {"bouncer": [f"127.0.0.1:{port}"],
                                                "vllm": [f"127.0.0.1:{p}" for p in engines]}, RULES)

        def targets_up() -> bool:
            up = _query(prom_url, "up")["data"]["result"]
            return len(up) == 3 and all(r["value"][1] == "1" for r in up)
        poll_until(targets_up, timeout=30, what="Prometheus scraping the gateway and both engines")
        asyncio.run(_traffic(base))
        time.sleep(25)  # enough scrapes after the traffic for every rate window

        with urllib.request.urlopen(prom_url + "/api/v1/label/__name__/values", timeout=10) as resp:
            exported = set(json.loads(resp.read())["data"])
        queries = [q for q in dashboard_queries() if not (SHARED_ONLY | QUOTA_ONLY) & set(METRIC.findall(q))] + \
            [q for q in rule_queries() if not DISCOVERY_ONLY & set(METRIC.findall(q))]
        named = {m for q in queries for m in METRIC.findall(q)}
        assert named - exported == set(), "metrics the dashboard or rules name that the demo does not export"

        quota_row = set(_row_queries("Quotas and overflow"))  # (answered by the test below)
        problems = _unanswered(prom_url, [q for q in dashboard_queries() if q not in quota_row
                                          and not (SHARED_ONLY | QUOTA_ONLY) & set(METRIC.findall(q))])
        for expr in rule_queries():  # the rules evaluate; the demo is healthy, so most find nothing to alert on
            answer = _query(prom_url, expr)
            if answer["status"] != "success":
                problems.append(f"{expr}: {answer.get('error')}")
        assert problems == []
        with urllib.request.urlopen(prom_url + "/api/v1/rules", timeout=10) as resp:
            groups = json.loads(resp.read())["data"]["groups"]
        assert {r["health"] for g in groups for r in g["rules"]} == {"ok"}
    finally:
        for proc in (prom, demo):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()




@pytest.mark.slow
def test_a_real_prometheus_scraping_two_gateways_sharing_redis_answers_the_several_gateways_row(tmp_path):
    from test_shared_state import TwoGateways

    # the row's other queries (in flight and agents elsewhere) the demo answers, in the test above
    row = [q for q in _row_queries("Several gateways (shared_state)") if SHARED_ONLY & set(METRIC.findall(q))]
    assert SHARED_ONLY <= {m for q in row for m in METRIC.findall(q)}  # the row shows each of them
    redis = RedisServer()
    gateways = prom = None
    try:
        gateways = TwoGateways(redis.url)
        poll_until(lambda: all(gateways.bg.call(lambda i=i: gateways.core(i).shared.peers_seen == 1)
                               for i in range(2)), timeout=10, what="each gateway reading the other's part")
        prom, prom_url = _prometheus(tmp_path, {"bouncer": [u.removeprefix("http://") for u in gateways.urls]})
        poll_until(lambda: len([r for r in _query(prom_url, "up")["data"]["result"] if r["value"][1] == "1"]) == 2,
                   timeout=30, what="Prometheus scraping both gateways")
        assert [code for code, _ in gateways.burst(8, key="free")] == [200] * 8
        time.sleep(25)  # enough scrapes for every rate window
        assert _unanswered(prom_url, row) == []
        up = _query(prom_url, "bouncer_shared_state_up")["data"]["result"]
        assert len(up) == 2 and all(r["value"][1] == "1" for r in up)
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        if gateways is not None:
            gateways.close()
        redis.stop()


@pytest.mark.slow
def test_a_real_prometheus_scraping_a_gateway_with_quotas_and_overflow_answers_their_row(tmp_path):
    from conftest import start_engine, start_gateway
    from servers import BackgroundLoop
    from test_quotas_live import _model, _stream, _tenant

    row = _row_queries("Quotas and overflow")
    assert QUOTA_ONLY <= {m for q in row for m in METRIC.findall(q)}
    redis = RedisServer()
    bg = BackgroundLoop()
    cleanups = []
    prom = None
    try:
        primary, _, stop_primary = start_engine(bg, speed=2.0)
        spare, _, stop_spare = start_engine(bg, speed=20.0)
        cleanups += [stop_primary, stop_spare]
        model = _model([primary], overflow=[{"name": "provider", "url": spare}])
        cfg = {"tenants": [_tenant("burst", overflow=True,
                                   quota={"limits": [{"window": "month", "limit": 10_000_000}]})],
               "models": [model], "quotas": {"url": redis.url},
               "policy": {"max_inflight_per_replica": 2, "queues": {"max_requests": 2}}}
        base, plane, stop_gateway = start_gateway(bg, cfg)
        cleanups.append(stop_gateway)
        prom, prom_url = _prometheus(tmp_path, {"bouncer": [base.removeprefix("http://")]})
        poll_until(lambda: [r["value"][1] for r in _query(prom_url, "up")["data"]["result"]] == ["1"], timeout=30,
                   what="Prometheus scraping the gateway")

        async def flood():
            return await asyncio.gather(*[_stream(base, "burst") for _ in range(16)])
        assert [code for code, _, _ in asyncio.run(flood())] == [200] * 16  # some of them served by the overflow
        time.sleep(25)  # enough scrapes for every rate window, and the quota levels read again
        assert _unanswered(prom_url, row) == []
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(10)
        for cleanup in reversed(cleanups):
            cleanup()
        bg.close()
        redis.stop()


def _row_queries(title: str) -> list[str]:
    """The queries of the dashboard's panels under the row `title`."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == title)
    out = []
    for p in panels[start + 1:]:
        if p["type"] == "row":
            break
        out += [t["expr"] for t in p["targets"]]
    return out

