"""Run aiohttp servers on loopback in a background thread, for end-to-end tests."""

from __future__ import annotations

import asyncio
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class BackgroundLoop:
    """An event loop in a daemon thread; `run(coro)` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start_task(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn: Callable[[], Any]) -> Any:
        async def wrapper():
            return fn()
        return self.run(wrapper())

    def close(self) -> None:
        """Cancel what still runs there and let it clean up (close sockets, terminate ZeroMQ
        contexts) before the loop stops: a context left open and collected later, in another
        test's thread, blocks that test for ever in its finalizer."""
        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            self.run(cancel_all(), timeout=10)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            # a loop left running would go on serving (and scraping) beside the next tests
            assert not self.thread.is_alive(), "a test's event loop did not stop"


def wait_answering(probe: Callable[[], bool], timeout: float, what: str) -> None:
    """Until `probe()` is true (an OSError from it counts as not yet), or TimeoutError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if probe():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout} s")
        time.sleep(0.05)


def wait_http_ok(url: str, timeout: float = 20) -> None:
    def answers() -> bool:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    wait_answering(answers, timeout, f"{url} did not answer 200")


def wait_started(proc: subprocess.Popen, url: str, log: pathlib.Path | None = None, timeout: float = 40) -> None:
    """Until the server `proc` started answers `url` with 200; if it exits first, fail at once
    with its exit code and the end of its log (a port taken, a config it refused), and if it
    never answers, with the end of its log too."""
    def tail() -> str:
        return log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""

    def answers() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"{' '.join(map(str, proc.args))} exited ({proc.returncode}) before "
                                 f"answering:\n{tail()}")
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    try:
        wait_answering(answers, timeout, f"{url} did not answer 200")
    except TimeoutError as exc:
        raise TimeoutError(f"{exc}; the end of its log:\n{tail()}") from None


def poll_until(predicate: Callable[[], bool], timeout: float = 20, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


class EngineProcess:
    """A `bouncer engine` in its own process, which a test can freeze, kill and start again."""

    def __init__(self, *args: str, host: str = "127.0.0.1", port: int | None = None) -> None:
        self.host = host  # any 127.x.y.z: several engines on one port, as pods behind one Service
        self.port = port or free_port()
        self.args = args
        self.url = f"http://{host}:{self.port}"
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bouncer", "engine", "--host", self.host,
                                      "--port", str(self.port), *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_http_ok(self.url + "/health")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def running(self) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(10)


def stop_all(bg_loop: BackgroundLoop, *stops: Callable[[], object]) -> None:
    """A live test's teardown: each stop in order (the gateway's cleanup, then what it fronts),
    then the background loop closed, whichever of them fails."""
    try:
        for stop in stops:
            stop()
    finally:
        bg_loop.close()

