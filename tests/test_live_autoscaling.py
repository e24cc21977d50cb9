"""Autoscaling live: a stand-in for KEDA (`bouncer bench provisioner`, its own process) reads the
gateway's demand gauge from `/metrics`, starts `bouncer engine` replicas after a start-up delay
and lists them in the file the gateway's discovery watches. From zero, the first request waits
for the first replica and is served; from one, a guidellm flood grows the pool; every request
ends with an answer or a refusal, and nothing stays in flight."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import openai
import pytest

from bouncer.bench import guidellm
from bouncer.config import key_digest
from conftest import start_gateway
from servers import poll_until

REPO = pathlib.Path(__file__).resolve().parents[1]
GUIDELLM = REPO / os.environ.get("BOUNCER_GUIDELLM", ".venv-guidellm/bin/guidellm")
STARTUP_S = 3.0


def _config(found: pathlib.Path) -> dict:
    return {"tenants": [{"name": "std", "api_keys_sha256": [key_digest("std")], "queue_ttl_s": 30}],
            "models": [{"name": "demo-llm", "hold_without_replicas_s": 60,
                        "discovery": {"file": {"path": str(found)}, "interval_s": 0.2, "keep_last_s": 0}}],
            "policy": {"telemetry": {"scrape_interval_s": 0.1, "staleness_s": 1.0}}}


@pytest.mark.slow
@pytest.mark.skipif(not GUIDELLM.exists(), reason=f"no guidellm at {GUIDELLM}: `make test` installs it")
def test_the_pool_grows_from_zero_and_from_one_on_the_demand_gauge_under_a_guidellm_flood(tmp_path, bg_loop):
    found = tmp_path / "replicas.json"
    found.write_text("[]\n")  # scaled to zero
    base, plane, cleanup = start_gateway(bg_loop, _config(found))
    provisioner = subprocess.Popen(
        [sys.executable, "-m", "bouncer", "bench", "provisioner", "--metrics", base + "/metrics", "--model", "demo-llm",
         "--file", str(found), "--startup", str(STARTUP_S), "--interval", "1", "--window", "4",
         "--scale-down-window", "20", "--drain", "20", "--max", "3", "--duration", "240",
         "--", "--kv-blocks", "2048", "--max-num-seqs", "64", "--speed", "0.25"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # from zero: the first request is held while the provisioner sees the demand and a
        # replica starts, then served
        client = openai.OpenAI(base_url=base + "/v1", api_key="std", max_retries=0, timeout=60)
        asked = time.monotonic()
        first = client.completions.create(model="demo-llm", prompt="the first one", max_tokens=8)
        assert first.choices[0].text and time.monotonic() - asked >= STARTUP_S
        # from one: guidellm at about 2.5x what one of these engines serves (8 of these a second)
        run = guidellm.run(GUIDELLM, base, "demo-llm", "std", rate=20, seconds=40, prompt_tokens=512,
                           output_tokens=64, workdir=tmp_path / "guidellm")
        # (incomplete: in flight when guidellm's 40 s ran out, cancelled by guidellm itself)
        assert run.total > 600 and run.successful > 0.9 * (run.total - run.incomplete)
        core = plane.core
        poll_until(lambda: bg_loop.call(lambda: core.view.inflight + core.view.queued) == 0, timeout=30,
                   what="in-flight and queued back at 0 after the flood")
        stats = bg_loop.call(lambda: core.stats)
        # every request ended: answered or refused, none lost track of
        assert stats.reclaimed == 0 and sum(stats.outcomes.values()) == stats.offered
    finally:
        provisioner.send_signal(signal.SIGTERM)
        out, err = provisioner.communicate(timeout=60)
        cleanup()
    events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    decisions = [e for e in events if e["event"] == "decision"]
    started = [e for e in events if e["event"] == "started"]
    assert provisioner.returncode == 0, err[-2000:]
    assert decisions[0]["ready"] == 0  # it began at zero
    # the held request asked for one replica, and the flood for more once that one served
    first_started = started[0]["t"]
    assert [d["desired"] for d in decisions if d["t"] <= first_started] [-1] == 1, events
    assert len(started) >= 2 and max(d["ready"] for d in decisions) >= 2, events
    assert events[-1]["event"] == "done" and json.loads(found.read_text()) == []  # its engines stopped with it
