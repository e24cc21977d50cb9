"""Fuzzing the gateway's own API from its OpenAPI description (docs/openapi.yaml) with
schemathesis: valid and invalid requests to every endpoint, under every kind of key. However
malformed the request, the answer is documented, never a 5xx on an idle fleet, and every error is
an OpenAI error body; afterwards nothing is in flight or queued and the engine runs nothing."""

from __future__ import annotations

import json
import pathlib

import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.openapi import from_path

from gateway_setup import Fleet, tenant
from servers import poll_until

SPEC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "openapi.yaml"
EXAMPLES = 3000
KEYS = [None, "alice", "free", "admin", "not-a-key"]

schema = from_path(str(SPEC))
OPERATIONS = [schema[path][method] for path, method in (
    ("/v1/chat/completions", "POST"), ("/v1/completions", "POST"), ("/v1/models", "GET"), ("/health", "GET"),
    ("/ready", "GET"), ("/metrics", "GET"), ("/admin/state", "GET"), ("/admin/drain", "POST"),
    ("/admin/undrain", "POST"), ("/admin/reload", "POST"))]
# generation is most of what is fuzzed: its bodies are where malformed input does harm
WEIGHTED = [op for op in OPERATIONS for _ in range(6 if op.path.startswith("/v1/") and op.method == "POST" else 1)]
STRATEGIES = [op.as_strategy(generation_mode=mode) for op in WEIGHTED
              for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]


@pytest.fixture(scope="module")
def fleet():
    from servers import BackgroundLoop
    loop = BackgroundLoop()
    f = Fleet(loop, [tenant("alice", priority=10, slo={"ttft_s": 5.0}), tenant("free", priority=-1)], engines=1,
              engine_kwargs={"num_blocks": 4096, "max_num_seqs": 64}, speed=8.0,
              limits={"max_body_bytes": 64 * 1024})
    yield f
    f.close()
    loop.close()


def _check(resp, where: str) -> None:
    """`resp`: schemathesis's response (headers as lists, names in lower case)."""
    assert resp.status_code < 500, (where, resp.status_code, resp.text[:300])
    ctype = (resp.headers.get("content-type") or [""])[0]
    if resp.status_code >= 400:
        assert ctype.startswith("application/json"), (where, resp.status_code, ctype, resp.text[:200])
        err = resp.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], (where, err)
    elif ctype.startswith("text/event-stream"):
        for line in resp.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert isinstance(json.loads(line[6:]), dict), (where, line)


@pytest.mark.slow
def test_fuzzed_requests_get_documented_answers_and_leave_nothing_behind(fleet):
    session = requests.Session()
    sent = {"n": 0}

    @settings(max_examples=EXAMPLES, phases=[Phase.generate], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data(), key=st.sampled_from(KEYS))
    def fuzz(data, key):
        case = data.draw(st.sampled_from(STRATEGIES).flatmap(lambda s: s))
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "authorization"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        resp = case.call(base_url=fleet.url, session=session, headers=headers, timeout=30)
        sent["n"] += 1
        _check(resp, f"{case.method} {case.formatted_path} {key}: {str(case.body)[:200]}")
        if case.path in ("/admin/drain", "/admin/undrain") and resp.status_code == 200:
            session.post(fleet.url + "/admin/undrain?model=demo-llm", headers={"Authorization": "Bearer admin"})

    fuzz()
    assert sent["n"] >= EXAMPLES
    core = fleet.gateway.core
    poll_until(lambda: fleet.call(lambda: core.view.inflight + core.view.queued) == 0, timeout=30, what="nothing left")
    engine = fleet.engines[0][1].engine
    poll_until(lambda: fleet.call(lambda: not engine.has_work), timeout=30, what="engine idle")
    stats = fleet.call(lambda: core.stats)
    assert sum(stats.outcomes.values()) == stats.offered  # every offered request ended once
    # the valid ones were served: how many of the 3,000 are valid, and served before the client's
    # 30 s timeout, depends on the generator's mix and the machine (50 in CI, 67 here, since the
    # precheck of issue 21; more than 50 before it, the cause not found)
    assert stats.outcomes["completed"] > 25
