"""Scale from zero, live: a model with no replica holds its requests (`hold_without_replicas_s`)
while one starts, and sends them when it is ready; past the hold, 503 no_backend with
Retry-After. The replica is a real `bouncer engine` process, found through a watched file as a
newly started pod would be."""

from __future__ import annotations

import threading
import time
import urllib.request

import openai
import pytest

from bouncer.config import key_digest
from conftest import start_gateway
from servers import EngineProcess, poll_until


def _config(found: str, hold_s: float) -> dict:
    return {"tenants": [{"name": "t", "api_keys_sha256": [key_digest("t")], "queue_ttl_s": 2,
                         "slo": {"ttft_s": 1.0}}],
            "admin_keys_sha256": [key_digest("admin")],
            "models": [{"name": "demo-llm", "hold_without_replicas_s": hold_s,
                        "discovery": {"file": {"path": found}, "interval_s": 0.2, "keep_last_s": 0}}],
            "policy": {"telemetry": {"scrape_interval_s": 0.05, "staleness_s": 1.0}}}


def _metric(base: str, prefix: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))


def _queued(base: str) -> float:
    return _metric(base, "bouncer_queue_depth{")


def _demand(base: str) -> float:
    return _metric(base, 'bouncer_demand_replicas{model="demo-llm",scope="all"}')


@pytest.mark.slow
def test_the_first_request_waits_for_a_replica_to_start_and_is_served(tmp_path, bg_loop):
    found = tmp_path / "replicas.yaml"
    found.write_text("[]\n")  # scaled to zero
    # hold past the tenant's 2 s TTL and its 1 s TTFT SLO: a replica takes longer than that to start
    base, _plane, cleanup = start_gateway(bg_loop, _config(str(found), hold_s=60))
    engine = None
    answers: list = []
    try:
        client = openai.OpenAI(base_url=base + "/v1", api_key="t", max_retries=0, timeout=60)

        def ask() -> None:
            answers.append(client.chat.completions.create(model="demo-llm", max_tokens=8,
                                                          messages=[{"role": "user", "content": "first"}]))
        asked = time.monotonic()
        first = threading.Thread(target=ask)
        first.start()
        # held, and visible to an autoscaler reading /metrics (as KEDA would)
        poll_until(lambda: _queued(base) == 1, timeout=10, what="the request held")
        time.sleep(3)  # longer than the tenant's TTL: held all the same
        assert first.is_alive() and not answers
        assert _demand(base) == 0.5  # the demand signal asks for a replica while it waits
        engine = EngineProcess()  # the replica the autoscaler started
        found.write_text(f"['{engine.url}']\n")
        first.join(60)
        assert answers and answers[0].choices[0].message.content
        assert time.monotonic() - asked >= 3
        assert _queued(base) == 0
    finally:
        cleanup()
        if engine is not None:
            engine.stop()


def _refused_no_backend(base: str) -> tuple[openai.APIStatusError, float]:
    """One request's refusal, and how long it took."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="t", max_retries=0, timeout=30)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="demo-llm", max_tokens=8,
                                       messages=[{"role": "user", "content": "anyone?"}])
    assert err.value.status_code == 503 and err.value.body["code"] == "no_backend"
    return err.value, time.monotonic() - started


@pytest.mark.parametrize("hold_s", [1.0, 0.0])
def test_without_a_replica_the_request_is_refused_no_backend_past_its_hold(tmp_path, bg_loop, hold_s):
    """Past a 1 s hold: 503 no_backend, saying no replica came up, with Retry-After; with no
    hold, at once."""
    found = tmp_path / "replicas.yaml"
    found.write_text("[]\n")
    base, _plane, cleanup = start_gateway(bg_loop, _config(str(found), hold_s=hold_s))
    try:
        err, waited = _refused_no_backend(base)
        assert err.response.headers.get("retry-after")
        if hold_s:
            assert "came up in time" in err.body["message"] and hold_s - 0.1 <= waited < 5
        else:
            assert waited < 1
    finally:
        cleanup()
