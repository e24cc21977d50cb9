"""Servers the benchmarks start on loopback: a free port for one, waiting until it answers, pinning
it to a core, its CPU time, and stopping it; and a redis-server of their own."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, timeout: float = 30) -> None:
    """Until `url` answers 200, or RuntimeError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout:g} s")


def pinned(cpu: int) -> list[str]:
    """The command prefix that runs a process on core `cpu` (taskset execs it, so the pid is the
    process's own), or nothing where there is no taskset or only one core."""
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and (os.cpu_count() or 1) > 1 else []


def runqueue_wait_seconds(pid: int) -> float:
    """Time a process's threads spent runnable but waiting for a CPU (the second field of each
    thread's schedstat): on a shared machine, how long others kept it off the cores."""
    total = 0
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[1])
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total / 1e9


def cpu_seconds(pid: int, children: bool = False) -> float:
    """Time on CPU of all of a process's threads (the first field of each thread's schedstat, in
    nanoseconds: finer than /proc/PID/stat's clock ticks); with `children`, of the processes it
    started too (nginx's workers)."""
    total = 0
    kids: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
            if children:
                kids += [int(k) for k in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended
    return total / 1e9 + sum(cpu_seconds(k, children=True) for k in kids)


def stop(procs: list[subprocess.Popen]) -> None:
    """Terminate the servers a benchmark started, and wait for them."""
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(10)


class RedisServer:
    """A `redis-server` of our own on a free loopback port, which a benchmark or a test may
    stop, freeze (SIGSTOP: it answers nothing) and start again: empty, or with `aof_dir` as it
    was (an append-only file there, fsynced on every write)."""

    def __init__(self, aof_dir: str | None = None) -> None:
        self.aof_dir = aof_dir
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("no redis-server: `apt-get install redis-server` (make system-tools does it)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        durability = ["--appendonly", "yes", "--appendfsync", "always", "--dir", self.aof_dir] if self.aof_dir \
            else ["--appendonly", "no"]
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      *durability], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        deadline = time.monotonic() + 10
        while not self._pong():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not come up on port {self.port}")
            time.sleep(0.05)

    def _pong(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
