"""A stand-in for KEDA, in real time: `bouncer engine` replicas started and stopped on the
demand gauge a gateway's `/metrics` shows, for live tests and demos (`bouncer bench provisioner`).

Every `interval_s` it reads `bouncer_demand_replicas{model=..., scope=...}` from each gateway's
`/metrics` (summed, as the recipes' PromQL does), averages it over `window_s` as
`avg_over_time` would, and asks for `ceil(demand / target)` replicas with the HPA's rules
(`bouncer.sim.provisioner.Provisioner`: the same code that drives the simulator's fleet). A
replica asked for waits `startup_s` (standing in for a GPU pod's driver, weights and health
checks), is started as a `bouncer engine` process on a free port, and once it answers is written
to the file the gateway's discovery watches (`models[].discovery.file`), as a pod becoming ready
enters a headless Service's DNS. A replica taken away is dropped from the file first; its process
is stopped once it holds no request (or after `drain_s`).

It prints one JSON line per decision (time, the demand read, replicas desired, ready, paid) and
one per replica started or stopped, and stops after `duration_s`, or on SIGTERM/SIGINT, taking
its engines with it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

from bouncer.sim.provisioner import Averaged, Provisioner, Signal

STEP_S = 0.5  # how often replicas are checked (started, drained); decisions every interval_s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def read_demand(metrics_urls: list[str], model: str, scope: str) -> float:
    """The gauge summed over the gateways (an unreachable one counts nothing, as a target down in
    Prometheus does)."""
    prefix = f'bouncer_demand_replicas{{model="{model}",scope="{scope}"}}'
    total = 0.0
    for url in metrics_urls:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                text = resp.read().decode()
        except OSError as exc:
            _say(event="scrape_failed", url=url, error=str(exc))
            continue
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix))
    return total


@dataclass
class Engines:
    """Real replicas: `bouncer engine` processes, listed in a discovery file while they serve."""

    file: str
    engine_args: list[str]
    drain_s: float = 30.0
    engines: dict[str, subprocess.Popen] = field(default_factory=dict)
    urls: dict[str, str] = field(default_factory=dict)
    retiring: dict[str, float] = field(default_factory=dict)  # name -> when it was taken out

    def serving(self) -> list[str]:
        return [n for n in self.engines if n not in self.retiring]

    def add_engine(self, name: str, now: float) -> None:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "bouncer", "engine", "--host", "127.0.0.1", "--port", str(port),
                                 *self.engine_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while not _answers(url + "/health"):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"engine {name} did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        self.engines[name], self.urls[name] = proc, url
        self.publish()
        _say(event="started", replica=name, url=url, t=round(now, 2))

    def retire(self, name: str, now: float) -> None:
        self.retiring[name] = now
        self.publish()
        _say(event="retiring", replica=name, t=round(now, 2))

    def reap(self, now: float) -> None:
        """Stop the replicas taken out that hold nothing any more (or have drained long enough)."""
        for name, since in list(self.retiring.items()):
            if now - since >= self.drain_s or _idle(self.urls[name]):
                self._stop(name)
                _say(event="stopped", replica=name, t=round(now, 2))

    def stop_all(self) -> None:
        for name in list(self.engines):
            self._stop(name)
        self.publish()

    def _stop(self, name: str) -> None:
        proc = self.engines.pop(name)
        self.retiring.pop(name, None)
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def publish(self) -> None:
        """The serving replicas' URLs, swapped in whole (a reader never sees half a file)."""
        text = json.dumps([self.urls[n] for n in self.serving()])
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(self.file)), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, self.file)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _idle(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=2) as resp:
            text = resp.read().decode()
    except OSError:
        return True  # gone already
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting"))) == 0


def run(metrics_urls: list[str], model: str, file: str, engine_args: list[str], scope: str = "all",
        target: float = 0.8, min_replicas: int = 0, max_replicas: int = 4, startup_s: float = 10.0,
        interval_s: float = 2.0, window_s: float = 10.0, scale_down_window_s: float = 30.0, drain_s: float = 30.0,
        duration_s: float = 300.0) -> None:
    fleet = Engines(file, engine_args, drain_s)
    fleet.publish()  # start from the replicas it runs: none
    t0 = time.monotonic()
    signal_ = Signal("demand", Averaged(window_s, lambda now: read_demand(metrics_urls, model, scope)), target)
    provisioner = Provisioner(signal_, min_replicas=min_replicas, max_replicas=max_replicas, startup_s=startup_s,
                              interval_s=interval_s, scale_down_window_s=scale_down_window_s, prefix="engine-")
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.append(True))
    try:
        while not stopping and time.monotonic() - t0 < duration_s:
            now = time.monotonic() - t0
            decided = len(provisioner.history)
            provisioner.step(fleet, now)
            if len(provisioner.history) > decided:
                _say(event="decision", **provisioner.history[-1])
            fleet.reap(now)
            time.sleep(STEP_S)
    finally:
        fleet.stop_all()
        _say(event="done", replica_seconds=round(provisioner.replica_seconds, 1))
