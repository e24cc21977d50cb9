"""A network partition between one gateway and Redis, cut for real: network namespaces and veth
links (this needs root, as CI has). Gateway 1 lives in its own namespace with one link to the
host (its clients, the engine) and one to Redis's namespace; gateway 2 runs on the host with its
own link to Redis. Cutting gateway 1's link to Redis must leave both serving, gateway 1 on its
share of the limits (fail-open) and gateway 2 still on the shared buckets; mending it must bring
gateway 1 back by itself. No 500 on either side. A gateway killed stops being counted (the
survivors' shares grow) once its presence lease runs out.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from bouncer.config import key_digest
from bouncer.tokenizer import default_tokenizer_path
from servers import free_port, poll_until, wait_answering, wait_http_ok

pytestmark = pytest.mark.slow
BOUNCER = str(pathlib.Path(sys.executable).with_name("bouncer"))


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Partitionable:
    """Namespaces `gw` and `redis`, linked gw<->host, redis<->host and gw<->redis."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10000}{random.randrange(100)}"
        self.gw_ns, self.redis_ns = f"bqg{tag}", f"bqr{tag}"
        net = random.randrange(16, 250)
        self.links: list[str] = []
        self.host_to_gw = self._link(self.gw_ns, f"10.77.{net}.0", "hg")
        self.host_to_redis = self._link(self.redis_ns, f"10.78.{net}.0", "hr")
        self.gw_to_redis = self._link(self.redis_ns, f"10.79.{net}.0", "gr", near_ns=self.gw_ns)

    def _link(self, far_ns: str, subnet: str, kind: str, near_ns: str | None = None) -> tuple[str, str]:
        """A veth pair from `near_ns` (the host if None) to `far_ns`: (near address, far address)."""
        for ns in (far_ns, near_ns):
            if ns and not pathlib.Path(f"/run/netns/{ns}").exists():
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
        near, far = f"{kind}{self.gw_ns[3:]}a", f"{kind}{self.gw_ns[3:]}b"
        base = subnet.rsplit(".", 1)[0]
        near_ip, far_ip = f"{base}.1", f"{base}.2"
        _ip("link", "add", near, "type", "veth", "peer", "name", far)
        self.links.append(near)
        _ip("link", "set", far, "netns", far_ns)
        if near_ns:
            _ip("link", "set", near, "netns", near_ns)
        pre = ["-n", near_ns] if near_ns else []
        _ip(*pre, "addr", "add", f"{near_ip}/30", "dev", near)
        _ip(*pre, "link", "set", near, "up")
        _ip("-n", far_ns, "addr", "add", f"{far_ip}/30", "dev", far)
        _ip("-n", far_ns, "link", "set", far, "up")
        return near_ip, far_ip

    def cut_gateway_from_redis(self, up: bool = False) -> None:
        _ip("-n", self.gw_ns, "link", "set", f"gr{self.gw_ns[3:]}a", "up" if up else "down")

    def close(self) -> None:
        for ns in (self.gw_ns, self.redis_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)


def _config(port: int, host: str, engine: str, redis_url: str) -> dict:
    return {
        "listen": {"host": host, "port": port},
        "tenants": [{"name": "limited", "api_keys_sha256": [key_digest("limited")],
                     "rate_limit": {"requests_per_s": 4, "request_burst": 4}}],
        "models": [{"name": "demo-llm", "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                    "max_model_len": 4096, "backends": [{"url": engine, "name": "e0"}]}],
        "shared_state": {"url": redis_url, "key_prefix": "part:", "lease_s": 3, "timeout_ms": 100,
                         "on_unavailable": "fail-open"},
    }


def _post(base: str) -> int:
    body = json.dumps({"model": "demo-llm", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": "Bearer limited"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


@pytest.fixture
def net():
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("redis-server"):
        pytest.fail("the partition test needs root, iproute2 and redis-server (CI has all three)")
    n = Partitionable()
    yield n
    n.close()


def test_a_gateway_cut_from_redis_goes_on_with_its_share_and_comes_back(net, tmp_path):
    procs: list[subprocess.Popen] = []
    try:
        redis_port = free_port()
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", net.redis_ns, "redis-server", "--port", str(redis_port), "--bind",
             net.host_to_redis[1], net.gw_to_redis[1], "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        engine_port = free_port()
        engine_host = net.host_to_gw[0]  # the host's end of the gateway's link: both gateways reach it
        procs.append(subprocess.Popen([BOUNCER, "engine", "--host", engine_host, "--port", str(engine_port),
                                       "--speed", "8"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        engine = f"http://{engine_host}:{engine_port}"
        wait_http_ok(engine + "/health")
        ports = free_port(), free_port()
        gw_hosts = net.host_to_gw[1], "127.0.0.1"
        redis_urls = f"redis://{net.gw_to_redis[1]}:{redis_port}/0", f"redis://{net.host_to_redis[1]}:{redis_port}/0"
        for i, ns in enumerate((net.gw_ns, None)):
            cfg = tmp_path / f"gw{i}.yaml"
            cfg.write_text(json.dumps(_config(ports[i], gw_hosts[i], engine, redis_urls[i])))
            cmd = [BOUNCER, "serve", "--config", str(cfg), "--log-level", "warning"]
            procs.append(subprocess.Popen((["ip", "netns", "exec", ns] if ns else []) + cmd,
                                          stdout=subprocess.DEVNULL, stderr=(tmp_path / f"gw{i}.log").open("wb")))
        bases = [f"http://{h}:{p}" for h, p in zip(gw_hosts, ports, strict=True)]
        for base in bases:
            wait_http_ok(base + "/ready", timeout=30)
        wait_answering(lambda: all(_metric(b, "bouncer_shared_state_gateways") == 2 for b in bases), 10,
                       "both gateways counted in Redis")

        net.cut_gateway_from_redis()
        codes = [_post(bases[0]) for _ in range(8)]
        assert set(codes) <= {200, 429}, codes  # fail-open: no 500, no 503
        assert 1 <= codes.count(200) <= 2 + 1, codes  # its half of the burst of 4 (and what refilled)
        assert _metric(bases[0], "bouncer_shared_state_up") == 0
        assert _metric(bases[1], "bouncer_shared_state_up") == 1  # the other side still shares
        time.sleep(1.0)
        assert _post(bases[1]) == 200

        net.cut_gateway_from_redis(up=True)
        poll_until(lambda: _metric(bases[0], "bouncer_shared_state_up") == 1, timeout=15,
                   what="gateway 1 back on Redis after the link mended")
        time.sleep(1.2)  # the shared bucket full again
        t0 = time.monotonic()
        codes = [_post(bases[i % 2]) for i in range(12)]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(200) <= 4 + 4 * (time.monotonic() - t0) + 1, codes  # one bucket again, for both

        procs[2].kill()  # gateway 1 dies without a word: its presence runs out after lease_s
        poll_until(lambda: _metric(bases[1], "bouncer_shared_state_gateways") == 1, timeout=3 + 2,
                   what="the dead gateway no longer counted")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
