"""Where the floor is under Bouncer's cost per request: two bare relays that do none of
Bouncer's work (no parsing, no tokenizing, no admission, no metrics), proxying the overhead
benchmark's request to its fast upstream through Bouncer's own upstream client, and Bouncer
itself, measured alike (`bouncer bench overhead`'s setup: the upstream and wrk on one core, the
server on the other; CPU time of the server's process and its children per request).

- `aiohttp`: aiohttp's server on uvloop, as Bouncer serves;
- `granian`: granian's Rust HTTP server calling an RSGI app on uvloop (`pip install granian`;
  reported missing where it is not installed).

    python scripts/server_floor.py [--seconds 6] [--out floor.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request

from bouncer.bench.loopback import cpu_seconds, free_port, pinned, stop, wait_ok
from bouncer.bench.overhead import BODY, _gateway_config, _wrk
from bouncer.tokenizer import default_tokenizer_path

RELAYS = '''
import os, sys
import yarl
from aiohttp import web
from bouncer.gateway.upstream import UpstreamPool

UP = yarl.URL(os.environ["FLOOR_UPSTREAM"] + "/v1/chat/completions")
_pool = []

async def relay(body: bytes) -> bytes:
    if not _pool:
        _pool.append(UpstreamPool(5.0, 300.0))
    up = await _pool[0].post_json(UP, body)
    try:
        return await up.read(300.0)
    finally:
        up.close()

async def handle(request):
    return web.Response(body=await relay(await request.read()), content_type="application/json")

async def rsgi_app(scope, proto):
    proto.response_bytes(200, [("content-type", "application/json")], await relay(await proto()))

if __name__ == "__main__":  # the aiohttp relay
    import uvloop
    uvloop.install()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
'''


def main(seconds: int, out: str | None) -> None:
    up_port = free_port()
    procs: list[subprocess.Popen] = []
    runs = []
    missing = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        (work / "relays.py").write_text(textwrap.dedent(RELAYS))
        env = {**os.environ, "FLOOR_UPSTREAM": f"http://127.0.0.1:{up_port}", "PYTHONPATH": str(work)}
        try:
            procs.append(subprocess.Popen([*pinned(0), sys.executable, "-m", "bouncer.bench.fast_upstream",
                                           "--port", str(up_port)]))
            wait_ok(f"http://127.0.0.1:{up_port}/metrics")
            servers: dict[str, tuple[int, subprocess.Popen]] = {}
            port = free_port()
            servers["aiohttp"] = (port, subprocess.Popen([*pinned(1), sys.executable, str(work / "relays.py"),
                                                          str(port)], env=env))
            if importlib.util.find_spec("granian") is not None:
                port = free_port()
                granian = [sys.executable, "-m", "granian", "--interface", "rsgi", "--loop", "uvloop", "--workers",
                           "1", "--host", "127.0.0.1", "--port", str(port), "relays:rsgi_app"]
                servers["granian"] = (port, subprocess.Popen([*pinned(1), *granian], env=env, cwd=work,
                                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            else:
                missing["granian"] = "pip install granian"
            port = free_port()
            cfg = json.loads(_gateway_config(f"http://127.0.0.1:{up_port}", port, recorder=False))
            cfg["models"][0]["tokenizer"] = str(default_tokenizer_path())
            (work / "gateway.yaml").write_text(json.dumps(cfg))
            servers["bouncer"] = (port, subprocess.Popen([*pinned(1), sys.executable, "-m", "bouncer", "serve",
                                                          "--config", str(work / "gateway.yaml"), "--log-level",
                                                          "warning"], stdout=subprocess.DEVNULL))
            procs += [p for _, p in servers.values()]
            for name, (port, proc) in servers.items():
                url = f"http://127.0.0.1:{port}/v1/chat/completions"
                _wait_post(url)
                for concurrency in (1, 16):
                    _wrk(url, False, concurrency, 1, work)  # warm-up
                    cpu0 = cpu_seconds(proc.pid, children=True)
                    rps, p50, p99, errors, total = _wrk(url, False, concurrency, seconds, work)
                    cpu_us = (cpu_seconds(proc.pid, children=True) - cpu0) / max(1, total) * 1e6
                    runs.append({"server": name, "concurrency": concurrency, "rps": rps, "p50_ms": p50,
                                 "p99_ms": p99, "errors": errors, "requests": total, "cpu_us_per_request": cpu_us})
        finally:
            stop(procs)
    lines = ["| server | conc. | req/s | p50 / p99 ms | CPU us/req | errors |", "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['server']} | {r['concurrency']} | {r['rps']:,.0f} | {r['p50_ms']:.2f} / "
                     f"{r['p99_ms']:.2f} | {r['cpu_us_per_request']:.0f} | {r['errors']} |")
    lines += [f"{name}: missing ({how})" for name, how in missing.items()]
    print("\n".join(lines))
    if out:
        pathlib.Path(out).write_text(json.dumps({"runs": runs, "missing": missing}, indent=2))
        print(f"saved {out}")


def _wait_post(url: str) -> None:
    """Until the server answers the benchmark's request (a relay has no /ready)."""
    body = json.dumps(BODY).encode()
    deadline = time.monotonic() + 30
    while True:
        req = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Authorization": "Bearer bench-key"})
        try:
            with urllib.request.urlopen(req, timeout=5):
                return
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=6)
    parser.add_argument("--out")
    args = parser.parse_args()
    main(args.seconds, args.out)
