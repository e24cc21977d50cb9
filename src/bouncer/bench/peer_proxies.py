"""The proxies users would put in Bouncer's place, started for `bouncer bench overhead` in front
of the same fast upstream, pinned as the gateway is: nginx as a plain reverse proxy (Debian's
`nginx-light`), the Rust `vllm-router` (PyPI; `$BOUNCER_VLLM_ROUTER` or on PATH) with
round-robin routing, and Envoy alone and with Bouncer as its endpoint picker
(`bouncer.bench.envoy_peers`). One that is not installed is reported missing, with how to
install it."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

from bouncer.bench import envoy_peers
from bouncer.bench.loopback import free_port, pinned, wait_ok

NGINX_CONF = """\
daemon off;
worker_processes 1;
pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {work}/nginx-body;
  proxy_temp_path {work}/nginx-proxy;
  upstream fast {{ server 127.0.0.1:{upstream}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://fast;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""

INSTALL = {"nginx": "apt-get install nginx-light", "envoy": envoy_peers.INSTALL,
           "vllm-router": "make .venv-peers/.installed (pip install vllm-router==0.1.17 in a venv of its own), "
                          "then BOUNCER_VLLM_ROUTER=.venv-peers/bin/vllm-router"}


class Peer:
    """A proxy under measurement: its URL and every process of it (whose CPU is counted)."""

    def __init__(self, name: str, url: str, procs: list[subprocess.Popen]) -> None:
        self.name, self.url, self.procs = name, url, procs

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]


def start_vllm_router(upstream_port: int) -> Peer | None:
    """The Rust vllm-router, round-robin over the upstream, on core 1; None where it is not
    installed."""
    router = os.environ.get("BOUNCER_VLLM_ROUTER") or shutil.which("vllm-router")
    if not router:
        return None
    port = free_port()
    proc = subprocess.Popen([*pinned(1), router, "--host", "127.0.0.1", "--port", str(port), "--worker-urls",
                             f"http://127.0.0.1:{upstream_port}", "--policy", "round_robin", "--log-level",
                             "warning", "--disable-retries", "--disable-circuit-breaker"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return Peer("vllm-router", f"http://127.0.0.1:{port}", [proc])


def start_peers(upstream_port: int, work: pathlib.Path, gateway_config: str | None = None,
                envoy_duplex: bool = False) -> tuple[list[Peer], dict[str, str]]:
    """The peers that are installed, started and answering; and those missing, with how to get
    them. `gateway_config` (the JSON config the proxy gateway runs): Envoy with Bouncer as its
    picker on that config too (`envoy_duplex`: in GIE's full-duplex setup as well)."""
    peers: list[Peer] = []
    missing: dict[str, str] = {}
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if pathlib.Path("/usr/sbin/nginx").exists() else None)
    if nginx:
        port = free_port()
        conf = work / "nginx.conf"
        conf.write_text(NGINX_CONF.format(work=work, upstream=upstream_port, port=port))
        proc = subprocess.Popen([*pinned(1), nginx, "-c", str(conf), "-p", str(work)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        peers.append(Peer("nginx", f"http://127.0.0.1:{port}", [proc]))
    else:
        missing["nginx"] = INSTALL["nginx"]
    router = start_vllm_router(upstream_port)
    if router:
        peers.append(router)
    else:
        missing["vllm-router"] = INSTALL["vllm-router"]
    envoy = envoy_peers.start_envoy(upstream_port, work)
    if envoy is None:
        missing["envoy"] = INSTALL["envoy"]
    else:
        peers.append(Peer("envoy", *envoy))
        if gateway_config is not None:
            peers.append(Peer("envoy+bouncer-epp", *envoy_peers.start_envoy_picker(gateway_config, work)))
            if envoy_duplex:
                peers.append(Peer("envoy+bouncer-epp-duplex",
                                  *envoy_peers.start_envoy_picker(gateway_config, work, duplex=True)))
    for peer in peers:
        wait_ok(peer.url + "/v1/models", timeout=60)
    return peers, missing
