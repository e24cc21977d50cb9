"""A gateway told to stop (SIGTERM, as Kubernetes stops a pod): /ready goes to 503 at once, the
requests it holds finish, and then it exits; one that holds nothing exits at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import yaml

from bouncer.config import key_digest
from servers import EngineProcess, free_port, poll_until, wait_http_ok


def _ready_status(base: str) -> int:
    try:
        with urllib.request.urlopen(base + "/ready", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _gateway(tmp_path, engine: EngineProcess, drain_s: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = {"listen": {"host": "127.0.0.1", "port": port, "drain_s": drain_s},
              "tenants": [{"name": "t", "api_keys_sha256": [key_digest("t")], "queue_ttl_s": 30}],
              "models": [{"name": "demo-llm", "backends": [{"url": engine.url}]}],
              "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 1.0}}}
    (tmp_path / "bouncer.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "bouncer", "serve", "--config", str(tmp_path / "bouncer.yaml")],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "gateway.log", "w"))
    base = f"http://127.0.0.1:{port}"
    wait_http_ok(base + "/ready", timeout=30)
    return proc, base


@pytest.mark.slow
def test_sigterm_drains_what_the_gateway_holds_then_exits(tmp_path):
    # one request at a time on the engine: three in flight, two of them waiting in the engine
    engine = EngineProcess("--max-num-seqs", "1")
    proc, base = _gateway(tmp_path, engine, drain_s=30)
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="t", max_retries=0, timeout=60)
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            stream = client.chat.completions.create(model="demo-llm", max_tokens=150, stream=True,
                                                    messages=[{"role": "user", "content": f"story {i}"}])
            answers[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.2)
        time.sleep(0.5)  # the first streams, the others wait
        proc.send_signal(signal.SIGTERM)
        poll_until(lambda: _ready_status(base) == 503, timeout=5, what="not ready while stopping")
        assert proc.poll() is None, "it exited with requests in hand"
        for t in threads:
            t.join(60)
        assert sorted(answers) == [0, 1, 2] and all(answers.values())
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        engine.stop()
    log = (tmp_path / "gateway.log").read_text()
    assert "stopping: finishing the requests held" in log and "msg=stopped" in log


def test_sigterm_with_nothing_held_exits_at_once(tmp_path):
    engine = EngineProcess()
    proc, _base = _gateway(tmp_path, engine, drain_s=30)
    try:
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - started < 5
    finally:
        if proc.poll() is None:
            proc.kill()
        engine.stop()
