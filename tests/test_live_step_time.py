"""The learned step time, live: a gateway whose config states nothing of the engine's step time,
in front of `bouncer engine` processes, driven by clients it did not write (the official openai
SDK, guidellm). It learns the engine's coefficients from its own requests, and with them keeps
the top tenant within its SLO through a sheddable flood, as it does with the true ones given."""

from __future__ import annotations

import os
import pathlib
import threading
import time
import urllib.request

import openai
import orjson
import pytest

from bouncer.bench import guidellm
from bouncer.sim.profiles import DEFAULT_PROFILE, get_profile
from conftest import start_gateway
from gateway_setup import Fleet, tenant
from servers import BackgroundLoop, EngineProcess, stop_all

REPO = pathlib.Path(__file__).resolve().parents[1]
# a relative path in the environment is from the repository
GUIDELLM = REPO / os.environ.get("BOUNCER_GUIDELLM", ".venv-guidellm/bin/guidellm")
SPEED = 4.0


def _state(base: str, admin_key: str = "admin") -> dict:
    req = urllib.request.Request(base + "/admin/state", headers={"Authorization": f"Bearer {admin_key}"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return orjson.loads(resp.read())


def test_with_no_step_time_configured_the_gateway_learns_it_and_refuses_what_cannot_be_met(bg_loop):
    fleet = Fleet(bg_loop, [tenant("alice", slo={"ttft_s": 2.0})], engines=1,
                  engine_kwargs={"num_blocks": 2048, "max_num_seqs": 32}, speed=SPEED)
    try:
        client = openai.OpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0)
        assert _state(fleet.url)["models"]["demo-llm"]["step_time"]["warm"] is False
        for i in range(12):  # prompts of several lengths: prefill and decode both show in the stream
            stream = client.completions.create(model="demo-llm", prompt="admission control " * (5 + 40 * i),
                                               max_tokens=16, stream=True, extra_body={"ignore_eos": True})
            assert sum(1 for c in stream if c.choices and c.choices[0].text) == 16
        step = _state(fleet.url)["models"]["demo-llm"]["step_time"]
        assert step["mode"] == "learned" and step["warm"], step
        true = get_profile(DEFAULT_PROFILE)
        # the engine runs its profile 4x faster: the fit finds a step of the right size (HTTP and
        # the event loop add their share to every step the gateway times)
        learned_step = step["coefficients"]["a"] + 64 * step["coefficients"]["b"]
        assert 0.5 < learned_step / ((true.a + 64 * true.b) / SPEED) < 3.0, step
        with pytest.raises(openai.RateLimitError) as err:  # one step alone is longer than 1 ms
            client.completions.create(model="demo-llm", prompt="hello", max_tokens=4,
                                      extra_headers={"x-bouncer-ttft-ms": "1"})
        assert err.value.response.json()["error"]["code"] == "deadline_infeasible"
        text = urllib.request.urlopen(fleet.url + "/metrics", timeout=5).read().decode()
        assert 'bouncer_model_step_time_coefficient{coefficient="b",model="demo-llm",source="learned"}' in text
        # once the band has 32 first tokens against their predictions, it plans with its own error
        for _ in range(32):
            stream = client.completions.create(model="demo-llm", prompt="admission control " * 20, max_tokens=2,
                                               stream=True, extra_body={"ignore_eos": True})
            assert sum(1 for c in stream if c.choices and c.choices[0].text) == 2
        margin = _state(fleet.url)["models"]["demo-llm"]["ttft_margins"]["0"]
        assert margin["observed"] >= 32 and 1.0 <= margin["margin"] <= 4.0, margin
        text = urllib.request.urlopen(fleet.url + "/metrics", timeout=5).read().decode()
        assert f'bouncer_ttft_margin{{band="0",model="demo-llm"}} {margin["margin"]}' in text
    finally:
        fleet.close()


def _top_request(client: openai.OpenAI, ttfts: list[float | None]) -> None:
    t0 = time.monotonic()
    got = None
    try:
        for chunk in client.completions.create(model="demo-llm", prompt="a quick question " * 8, max_tokens=16,
                                               stream=True, extra_body={"ignore_eos": True}):
            if got is None and chunk.choices and chunk.choices[0].text:
                got = time.monotonic() - t0
    except openai.APIError:
        pass
    ttfts.append(got)


def _top_tenant(base: str, requests: int, ttfts: list[float | None]) -> None:
    """The priority tenant: one short streamed request a second (open loop: each in its own
    thread) through the openai SDK with its default retries; TTFT counted from the first attempt
    (None: it never got a token)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="top", timeout=30)
    threads = []
    for _ in range(requests):
        threads.append(threading.Thread(target=_top_request, args=(client, ttfts)))
        threads[-1].start()
        time.sleep(1.0)
    for t in threads:
        t.join(60)


@pytest.mark.slow
@pytest.mark.skipif(not GUIDELLM.exists(), reason=f"no guidellm at {GUIDELLM}: `make test` installs it")
def test_the_top_tenant_keeps_its_slo_through_a_4x_sheddable_flood_with_no_step_time_configured(tmp_path):
    """The live run of the issue that found priority depended on a constant nobody has: one
    engine at 0.25x speed (about 8 req/s of 512-in / 64-out), guidellm flooding as a sheddable
    tenant at 4x for 45 s, the top tenant (1 s TTFT SLO) streaming through it from second 10."""
    bg_loop = BackgroundLoop()
    engine = EngineProcess("--kv-blocks", "2048", "--max-num-seqs", "64", "--speed", "0.25")
    base, gw, cleanup = start_gateway(bg_loop, {
        "admin_keys_sha256": [],
        "tenants": [tenant("top", priority=10, slo={"ttft_s": 1.0}), tenant("flood", priority=-1)],
        "models": [{"name": "demo-llm", "max_model_len": 8192, "backends": [{"url": engine.url, "name": "e0"}]}],
        "policy": {"telemetry": {"scrape_interval_s": 0.1, "staleness_s": 1.0}},
    })
    try:
        flood: dict = {}
        t = threading.Thread(target=lambda: flood.update(run=guidellm.run(
            GUIDELLM, base, "demo-llm", "flood", rate=32, seconds=45, prompt_tokens=512, output_tokens=64,
            workdir=tmp_path / "guidellm")))
        t.start()
        time.sleep(10)  # the flood's requests teach the gateway the engine's step time
        ttfts: list[float | None] = []
        _top_tenant(base, 30, ttfts)
        t.join(240)
        step = bg_loop.call(lambda: gw.core.view.snapshot(gw.clock()))["models"]["demo-llm"]["step_time"]
        assert step["warm"], step
        run = flood["run"]
        assert run.errored > 0.2 * run.total  # overload: the flood was pushed back
        within = sum(1 for x in ttfts if x is not None and x <= 1.0)
        # the target is 99% (30 of 30 in every published run: docs/benchmarks/live.md, "Live"); on a
        # shared 2-core CI machine one of the 30 has been seen to miss (1 run in 4), so one is allowed
        assert len(ttfts) == 30 and within >= len(ttfts) - 1, (within, ttfts, step)
    finally:
        stop_all(bg_loop, cleanup, engine.stop)
