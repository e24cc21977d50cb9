"""Backends found while the gateway runs (`discovery:`): from a real DNS server (Debian's dnsmasq,
started here on a free port, its records changed while the gateway runs) and from a watched file,
with real `bouncer engine` processes coming and going under load."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
import yaml

from bouncer.config import ConfigError, key_digest, parse_config
from bouncer.demo import DEMO_ADMIN_KEY, demo_config
from bouncer.gateway.discovery import Finder, LookupFailed, lookup_file
from servers import EngineProcess, poll_until, wait_http_ok

DNSMASQ = shutil.which("dnsmasq") or "/usr/sbin/dnsmasq"


def free_udp_tcp_port() -> int:
    """A port free for both UDP and TCP on 127.0.0.1 (a DNS server listens on both)."""
    while True:
        with socket.socket() as t:
            t.bind(("127.0.0.1", 0))
            port = t.getsockname()[1]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
                try:
                    u.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port


class Dnsmasq:
    """Debian's dnsmasq on 127.0.0.1:PORT, authoritative for `.test`: A records from a hosts file
    (`set_hosts` rewrites it, SIGHUP re-reads it, as a headless Service's endpoints change), SRV
    records fixed at start (`restart` with others)."""

    def __init__(self, tmp: Path, hosts: dict[str, list[str]], srv: list[str] = ()) -> None:
        self.tmp = tmp
        self.hosts = tmp / "hosts"
        self.port = free_udp_tcp_port()
        self.proc: subprocess.Popen | None = None
        self.set_hosts(hosts, reread=False)
        self.start(srv)

    def start(self, srv: list[str] = ()) -> None:
        assert os.path.exists(DNSMASQ), "dnsmasq missing: `make system-tools` installs Debian's dnsmasq-base"
        self.proc = subprocess.Popen(
            [DNSMASQ, "--keep-in-foreground", f"--port={self.port}", "--listen-address=127.0.0.1",
             "--bind-interfaces", "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}", "--local=/test/",
             "--pid-file=", "--user=root", "--log-facility=-", *(f"--srv-host={s}" for s in srv)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        poll_until(lambda: self.answers(), what="dnsmasq answering")

    def answers(self) -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0

    def set_hosts(self, hosts: dict[str, list[str]], reread: bool = True) -> None:
        self.hosts.write_text("".join(f"{ip} {name}\n" for name, ips in hosts.items() for ip in ips))
        if reread:
            self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def restart(self, srv: list[str] = ()) -> None:
        self.stop()
        self.start(srv)


def _get(url: str, key: str = DEMO_ADMIN_KEY) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def _served(engine: EngineProcess) -> float:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as resp:
        return sum(float(line.split()[-1]) for line in resp.read().decode().splitlines()
                   if line.startswith("vllm:request_success_total"))


class Load:
    """Clients that send the demo's traffic (the openai SDK, no retries: every failure counts)
    until stopped: streamed and whole answers, the interactive and research tenants."""

    def __init__(self, base: str, clients: int = 6) -> None:
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._loop, args=(base, i), daemon=True) for i in range(clients)]
        for t in self._threads:
            t.start()

    def _loop(self, base: str, i: int) -> None:
        key = "demo-interactive" if i % 2 else "demo-research"
        client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)
        n = 0
        while not self._stop.is_set():
            n += 1
            messages = [{"role": "user", "content": f"client {i} asks question {n}: how do pods come and go?"}]
            try:
                if n % 2:
                    stream = client.chat.completions.create(model="demo-llm", messages=messages, max_tokens=12,
                                                            stream=True)
                    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
                else:
                    text = client.chat.completions.create(model="demo-llm", messages=messages,
                                                          max_tokens=12).choices[0].message.content
                assert text, "an empty answer"
                with self._lock:
                    self.done += 1
            except Exception as exc:  # noqa: BLE001 (every failure is recorded and fails the test)
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


def _replicas(base: str) -> dict:
    return _get(base + "/admin/state")["models"]["demo-llm"]["replicas"]


def _discovery(base: str) -> dict:
    return _get(base + "/admin/state")["models"]["demo-llm"]["discovery"]


@pytest.mark.slow
def test_dns_discovery_replicas_come_and_go_under_load(tmp_path):
    """The demo's config with `discovery: {dns: ...}` and no `backends:` serves the demo's
    traffic while a replica is added, one removed (drained, then its process killed) and the DNS
    server is down a while: nothing lost, no 5xx."""
    port = free_udp_tcp_port()
    engines = {ip: EngineProcess(host=ip, port=port) for ip in ("127.0.0.2", "127.0.0.3")}
    dns = Dnsmasq(tmp_path, {"vllm.test": list(engines)})
    cfg = demo_config().model_dump(mode="json")
    model = cfg["models"][0]
    del model["backends"]
    model["discovery"] = {"dns": {"name": "vllm.test", "port": port, "server": f"127.0.0.1:{dns.port}"},
                          "interval_s": 0.3, "keep_last_s": 60}
    gw_port = free_udp_tcp_port()
    cfg["listen"].update(host="127.0.0.1", port=gw_port)
    (tmp_path / "bouncer.yaml").write_text(yaml.safe_dump(cfg))
    check = subprocess.run([sys.executable, "-m", "bouncer", "config", "check", str(tmp_path / "bouncer.yaml")],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert f"found by dns A vllm.test @127.0.0.1:{dns.port}" in check.stdout
    gateway = subprocess.Popen([sys.executable, "-m", "bouncer", "serve", "--config", str(tmp_path / "bouncer.yaml")],
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "gateway.log", "w"))
    base = f"http://127.0.0.1:{gw_port}"
    load = None
    try:
        wait_http_ok(base + "/ready", timeout=30)  # ready: the first lookup found replicas that answer
        names = {f"demo-llm/{ip}:{port}" for ip in engines}
        assert set(_replicas(base)) == names
        load = Load(base)
        poll_until(lambda: all(_served(e) >= 3 for e in engines.values()), timeout=30, what="both replicas serving")

        # a pod is added: it appears in DNS, is scraped, and gets work
        engines["127.0.0.4"] = EngineProcess(host="127.0.0.4", port=port)
        dns.set_hosts({"vllm.test": list(engines)})
        poll_until(lambda: _served(engines["127.0.0.4"]) >= 3, timeout=30, what="the new replica serving")

        # a pod is removed: gone from DNS first (as a terminating pod leaves its Service's
        # endpoints), it finishes what it holds and gets nothing new; then it is killed
        gone = engines.pop("127.0.0.2")
        dns.set_hosts({"vllm.test": list(engines)})
        gone_name = f"demo-llm/127.0.0.2:{port}"
        poll_until(lambda: gone_name not in _replicas(base) or (_replicas(base)[gone_name]["removed"] and
                                                                _replicas(base)[gone_name]["inflight"] == 0),
                   timeout=30, what="the removed replica drained")
        served_before = _served(gone)
        time.sleep(1.0)
        assert _served(gone) == served_before, "a replica gone from DNS still got work"
        gone.stop()

        # DNS down: the last known replicas are kept, and the gateway says so
        dns.stop()
        poll_until(lambda: _discovery(base)["stale"], timeout=10, what="discovery stale")
        assert _discovery(base)["replicas"] == 2 and _discovery(base)["last_error"]
        done = load.done
        poll_until(lambda: load.done >= done + 10, timeout=30, what="traffic served while DNS is down")
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        assert 'bouncer_discovery_stale{model="demo-llm"} 1.0' in metrics
        assert 'bouncer_discovery_replicas{model="demo-llm"} 2.0' in metrics
        dns.start()
        poll_until(lambda: not _discovery(base)["stale"], timeout=10, what="discovery answering again")

        load.stop()
        assert load.failures == [], load.failures[:5]
        assert load.done >= 60
        live = {n for n, r in _replicas(base).items() if not r["removed"]}
        assert live == {f"demo-llm/{ip}:{port}" for ip in engines}
        state = _get(base + "/admin/state")
        assert state["inflight"] == 0 and state["serving"] == 0
        assert all(r["inflight"] == 0 for r in _replicas(base).values())
    finally:
        if load is not None:
            load.stop()
        gateway.terminate()
        gateway.wait(15)
        dns.stop()
        for e in engines.values():
            e.stop()
    log = (tmp_path / "gateway.log").read_text()
    assert "replicas changed" in log and "discovery failed: the last known replicas are kept" in log


def test_srv_records_and_a_lost_dns_server(tmp_path, bg_loop):
    """SRV records carry each replica's port; a DNS server gone for longer than keep_last_s
    empties the model (not ready), and the next answer fills it again."""
    from conftest import start_gateway
    from gateway_setup import tenant

    engines = [EngineProcess(), EngineProcess()]
    srv = [f"_http._tcp.vllm.test,e{i}.test,{e.port}" for i, e in enumerate(engines)]
    dns = Dnsmasq(tmp_path, {f"e{i}.test": ["127.0.0.1"] for i in range(2)}, srv=srv)
    config = {"tenants": [tenant("t")], "admin_keys_sha256": [],
              "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 1.0}},
              "models": [{"name": "demo-llm", "discovery": {
                  "dns": {"name": "_http._tcp.vllm.test", "record": "SRV", "server": f"127.0.0.1:{dns.port}"},
                  "interval_s": 0.2, "keep_last_s": 1.0}}]}
    base, plane, cleanup = start_gateway(bg_loop, config)
    try:
        names = lambda: sorted(n for n, r in bg_loop.call(lambda: plane.core.replicas).items()  # noqa: E731
                               if not r.removed)
        assert names() == [f"demo-llm/e0.test:{engines[0].port}", f"demo-llm/e1.test:{engines[1].port}"]
        wait_http_ok(base + "/ready")
        client = openai.OpenAI(base_url=base + "/v1", api_key="t", max_retries=0)
        assert client.chat.completions.create(model="demo-llm", max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}]).choices
        dns.restart(srv=srv[1:])
        poll_until(lambda: names() == [f"demo-llm/e1.test:{engines[1].port}"], what="SRV record removed")
        # gone longer than keep_last_s: no replicas, not ready
        dns.stop()
        poll_until(lambda: names() == [], timeout=10, what="replicas dropped after keep_last_s")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(base + "/ready", timeout=5)
        assert err.value.code == 503
        dns.start(srv=srv)
        poll_until(lambda: len(names()) == 2, timeout=10, what="replicas found again")
        wait_http_ok(base + "/ready")
    finally:
        cleanup()
        dns.stop()
        for e in engines:
            e.stop()


def _write(path: Path, data) -> None:
    """Replace the file at once, as Kubernetes swaps a mounted ConfigMap (a rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data))
    tmp.replace(path)


def test_file_discovery_follows_the_file(tmp_path, bg_loop):
    """A watched file (Prometheus file_sd groups, then URLs): replicas follow it; a file that
    does not parse keeps the last set and says why."""
    from conftest import start_gateway
    from gateway_setup import tenant

    engines = [EngineProcess(), EngineProcess()]
    path = tmp_path / "backends.yaml"
    _write(path, [{"targets": [f"127.0.0.1:{engines[0].port}"], "labels": {"zone": "a"}}])
    config = {"tenants": [tenant("t")], "admin_keys_sha256": [key_digest("admin")],
              "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 1.0}},
              "models": [{"name": "demo-llm", "discovery": {"file": {"path": str(path)}, "interval_s": 0.1,
                                                            "kv_blocks": 512}}]}
    base, plane, cleanup = start_gateway(bg_loop, config)
    try:
        live = lambda: {n: r.configured_blocks for n, r in bg_loop.call(lambda: plane.core.replicas).items()  # noqa: E731
                        if not r.removed}
        assert live() == {f"demo-llm/127.0.0.1:{engines[0].port}": 512}
        _write(path, [e.url for e in engines])
        poll_until(lambda: len(live()) == 2, what="the second replica")
        client = openai.OpenAI(base_url=base + "/v1", api_key="t", max_retries=0)
        for _ in range(4):
            assert client.chat.completions.create(model="demo-llm", max_tokens=4,
                                                  messages=[{"role": "user", "content": "hi"}]).choices
        path.write_text("- url: [not, a, string]\n")  # written in place: it may be read half-written
        finder = bg_loop.call(lambda: plane.finders.by_model["demo-llm"][0])
        poll_until(lambda: "entry 0" in (finder.status.last_error or ""), what="the bad file noticed")
        assert finder.status.stale_since is not None and len(live()) == 2
        _write(path, [{"url": engines[1].url, "name": "second", "kv_blocks": 1024}])
        poll_until(lambda: live() == {"second": 1024}, what="the first replica gone")
        assert finder.status.stale_since is None

        # a reload keeps what the finder holds (the file config lists no backends) ...
        def reload(cfg: dict) -> None:
            req = urllib.request.Request(base + "/admin/reload", data=json.dumps(cfg).encode(), method="POST",
                                         headers={"Authorization": "Bearer admin"})
            with urllib.request.urlopen(req, timeout=10) as resp:
                assert json.loads(resp.read())["reloaded"]
        config["tenants"][0]["priority"] = 5
        reload(config)
        assert live() == {"second": 1024} and bg_loop.call(lambda: plane.finders.by_model["demo-llm"][0]) is finder
        # ... and one that points discovery elsewhere keeps it until the new source answers
        other = tmp_path / "other.yaml"
        _write(other, [engines[0].url])
        config["models"][0]["discovery"]["file"]["path"] = str(other)
        reload(config)
        poll_until(lambda: live() == {f"demo-llm/127.0.0.1:{engines[0].port}": 512}, what="the new source's set")
    finally:
        cleanup()
        for e in engines:
            e.stop()


# -- without servers ---------------------------------------------------------------------------
TENANTS = [{"name": "t", "api_keys_sha256": ["0" * 64]}]


def _model(discovery: dict, **kw) -> dict:
    return {"tenants": TENANTS, "models": [{"name": "m", "discovery": discovery, **kw}]}


@pytest.mark.parametrize(("discovery", "extra", "message"), [
    ({"dns": {"name": "vllm.test"}}, {}, "needs the engines' port"),
    ({"dns": {"name": "vllm.test", "record": "SRV", "port": 80}}, {}, "leave port out"),
    ({"interval_s": 1}, {}, "one source: dns or file"),
    ({"dns": {"name": "a", "port": 1}, "file": {"path": "x"}}, {}, "one source: dns or file"),
    ({"file": {"path": "x"}}, {"backends": [{"url": "http://a:1"}]}, "not both"),
])
def test_discovery_config_errors(discovery, extra, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(_model(discovery, **extra))


def test_a_model_needs_backends_or_discovery():
    with pytest.raises(ConfigError, match="needs backends"):
        parse_config({"tenants": TENANTS, "models": [{"name": "m"}]})


def test_file_formats_and_errors(tmp_path):
    d = parse_config(_model({"file": {"path": str(tmp_path / "f.yaml")}, "kv_events_port": 5557,
                             "kv_blocks": 64})).models[0].discovery
    f = tmp_path / "f.yaml"
    f.write_text(json.dumps(["http://10.0.0.5:8000/", {"targets": ["10.0.0.6:8000", "[fd00::7]:8000"]},
                             {"url": "https://gpu-3:9000", "name": "big", "kv_blocks": 4096}]))
    found = {b.name: b for b in lookup_file("m", d)}
    assert set(found) == {"m/10.0.0.5:8000", "m/10.0.0.6:8000", "m/[fd00::7]:8000", "big"}
    assert found["m/10.0.0.5:8000"].url == "http://10.0.0.5:8000"
    assert found["m/10.0.0.5:8000"].kv_events == "tcp://10.0.0.5:5557"
    assert found["m/[fd00::7]:8000"].kv_events == "tcp://[fd00::7]:5557"
    assert (found["big"].kv_blocks, found["m/10.0.0.6:8000"].kv_blocks) == (4096, 64)
    for text, message in [("{a: 1}", "top level must be a list"), ("[3]", "entry 0: a URL"),
                          ("['ftp://x']", "entry 0: url: .*http"), ("[{name: x}]", "needs a url"),
                          ("[{url: 'http://a:1', role: decode}]", "role both"),
                          ("[{url: 'http://a:1', colour: red}]", "colour"), ("[: x", "f.yaml")]:
        f.write_text(text)
        with pytest.raises(LookupFailed, match=message):
            lookup_file("m", d)
    f.unlink()
    with pytest.raises(LookupFailed, match="No such file"):
        lookup_file("m", d)


def test_finder_keeps_the_last_set_for_keep_last_s(tmp_path):
    """Failed or empty lookups keep the last set for keep_last_s (then none); an answer again
    clears the stale mark. One change handed on per new set."""
    import asyncio

    f = tmp_path / "f.yaml"
    m = parse_config(_model({"file": {"path": str(f)}, "keep_last_s": 10})).models[0]
    now = [0.0]
    changes: list[list[str]] = []
    finder = Finder(m, lambda found: changes.append([b.url for b in found]), lambda: now[0])
    run = lambda: asyncio.run(finder.once())  # noqa: E731
    f.write_text("['http://a:1', 'http://b:1']")
    assert run() and changes == [["http://a:1", "http://b:1"]]
    assert run() and len(changes) == 1  # the same set: nothing handed on
    f.write_text("[]")
    now[0] = 5.0
    assert not run() and finder.status.stale_since == 5.0 and len(changes) == 1
    f.write_text("not: [a list")
    now[0] = 14.0
    assert not run() and len(changes) == 1 and "f.yaml" in finder.status.last_error
    now[0] = 15.0
    assert not run() and changes[-1] == []
    f.write_text("['http://b:1']")
    now[0] = 16.0
    assert run() and changes[-1] == ["http://b:1"] and finder.status.stale_since is None
    assert finder.status.as_dict(now[0])["changes"] == 3


def test_a_file_read_half_written_is_not_believed(tmp_path, monkeypatch):
    """A file written in place can be read cut short, and a list cut short still parses: a
    changed set counts once a second read agrees; reads that disagree are a failed lookup, and
    the set in force stays."""
    import asyncio

    from bouncer.gateway import discovery

    f = tmp_path / "f.yaml"
    f.write_text("['http://a:1', 'http://b:1']")
    m = parse_config(_model({"file": {"path": str(f)}})).models[0]
    changes: list[list[str]] = []
    finder = Finder(m, lambda found: changes.append([b.url for b in found]), lambda: 0.0)
    assert asyncio.run(finder.once()) and changes == [["http://a:1", "http://b:1"]]
    reads = iter([["http://a:1"], ["http://a:1", "http://b:1"]])  # the first read caught it mid-write
    real = discovery.lookup_file

    def lookup_file(model, d):
        keep = next(reads)
        return [b for b in real(model, d) if b.url in keep]
    monkeypatch.setattr(discovery, "lookup_file", lookup_file)
    assert not asyncio.run(finder.once())
    assert "changed as it was read" in finder.status.last_error and len(changes) == 1


def test_envoy_fails_open_to_the_dns_name():
    """`bouncer envoy-config --failure-mode open`: the picker down, Envoy sends to the replicas
    itself, which it finds by the same DNS name (STRICT_DNS); a file or SRV discovery it cannot
    follow is refused with the reason."""
    from bouncer.gateway.fronts.envoy_bootstrap import bootstrap

    config = parse_config(_model({"dns": {"name": "vllm.inference.svc.cluster.local", "port": 8000}}))
    clusters = {c["name"]: c for c in bootstrap(config, fail_open=True)["static_resources"]["clusters"]}
    endpoints = clusters["bouncer-backends"]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"] for e in endpoints] == [
        {"address": "vllm.inference.svc.cluster.local", "port_value": 8000}]
    assert clusters["bouncer-backends"]["type"] == "STRICT_DNS"
    with pytest.raises(ValueError, match="fail closed, or list them"):
        bootstrap(parse_config(_model({"file": {"path": "f.yaml"}})), fail_open=True)
    assert "bouncer-backends" not in {c["name"] for c in bootstrap(parse_config(_model({"file": {"path": "f"}})))[
        "static_resources"]["clusters"]}
