"""The flight recorder with explicit time: the sampler's counts and gauges, the ring, its file
format, and /admin/timeline (JSON, JSON Lines, coarser steps, the live stream, keys, reload)."""

from __future__ import annotations

import gzip
import json
import threading
import urllib.error
import urllib.request

import pytest

from bouncer.config import ConfigError, key_digest, parse_config
from bouncer.core.outcomes import Terminal
from bouncer.recorder.sampler import Sampler
from bouncer.recorder.timeline import Timeline, TimelineFormatError, coarsen
from core_helpers import dispatched, info, make_config, make_core, rejected, tenant
from gateway_setup import Fleet
from gateway_setup import tenant as gw_tenant


def _core():
    return make_core(tenants=[tenant("top", 10, slo={"ttft_s": 1.0}), tenant("low", -1,
                                                                             rate_limit={"requests_per_s": 1})],
                     replicas=1)


def test_a_sample_counts_what_happened_since_the_last_and_holds_the_state_now():
    core = _core()
    sampler = Sampler()
    first = sampler.sample(core.view, 0.0, 100.0)
    assert first["t"] == 100.0 and first["counts"]["tenants"] == {}
    assert first["gauges"]["tenants"]["top"]["band"] == 10 and first["gauges"]["tenants"]["low"]["band"] == -1

    top = [dispatched(core.offer(info("top"), 0.1)) for _ in range(3)]
    assert all(len(d) == 1 for d in top)
    low = [core.offer(info("low"), 0.2) for _ in range(4)]  # 1 req/s: past its burst, refused
    refused = sum(len(rejected(e)) for e in low)
    assert 1 <= refused < 4
    core.started(top[0][0].request_id, 0.3)
    core.finished(top[0][0].request_id, 0.5, Terminal.COMPLETED, 10)

    s = sampler.sample(core.view, 0.5, 100.5)
    c = s["counts"]["tenants"]
    assert c["top"] == {"arrived": 3, "admitted": 3, "completed": 1, "slo_total": 1, "slo_met": 1}
    assert c["low"]["arrived"] == 4 and c["low"]["refused:rate_limited_requests"] == refused
    assert c["low"]["admitted"] == 4 - refused
    assert s["gauges"]["inflight"] == 2 + 4 - refused  # two of top's, low's admitted
    replica = next(iter(s["gauges"]["models"]["m"]["replicas"].values()))
    assert replica["inflight"] == 6 - refused and replica["kv_usage"] == 0.0 and replica["running"] == 0

    again = sampler.sample(core.view, 0.75, 100.75)  # nothing new: no counts
    assert again["counts"]["tenants"] == {}


def test_queued_requests_show_per_band_and_tenant_with_their_oldest_wait():
    # 1 replica of 100 blocks, 13 a request: six fit under 0.9, the rest queue
    core = make_core(tenants=[tenant("a"), tenant("low", -1)], replicas=1, kv_blocks=100,
                     policy={"kv_busy_threshold": 0.9, "kv_resume_threshold": 0.5,
                             "saturation": {"kv_threshold": 1.0}, "sheddable_ceiling": 2.0})
    sampler = Sampler()
    assert sum(len(dispatched(core.offer(info(), 0.0))) for _ in range(6)) == 6
    for t in (0.5, 1.0):
        assert core.offer(info(), t) == []
    assert core.offer(info("low"), 1.25) == []
    s = sampler.sample(core.view, 1.5, 1.5)
    bands = s["gauges"]["models"]["m"]["bands"]
    assert bands["0"]["queued"] == 2 and bands["0"]["oldest_wait_s"] == pytest.approx(1.0)
    assert bands["-1"]["queued"] == 1 and bands["-1"]["oldest_wait_s"] == pytest.approx(0.25)
    assert bands["-1"]["ceiling"] == 2.0 and bands["0"]["ceiling"] == core.policy.default_ceiling
    assert s["gauges"]["tenants"]["a"] == {"queued": 2, "oldest_wait_s": 1.0, "band": 0}
    assert s["counts"]["tenants"]["a"] == {"arrived": 8, "admitted": 6}


def _sample(t: float, arrived: int, queued: int) -> dict:
    return {"t": t, "counts": {"tenants": {"a": {"arrived": arrived}}}, "gauges": {"queued": queued}}


def test_the_ring_keeps_its_horizon_and_says_how_much_memory_it_holds():
    tl = Timeline(step_s=0.5, horizon_s=2.0)
    assert tl.capacity == 4
    for i in range(10):
        tl.append(_sample(i * 0.5, i, i))
    assert len(tl) == 4 and tl.oldest() == 3.0 and tl.newest() == 4.5
    assert tl.bytes_held == sum(len(b) for b in tl.encoded())
    assert [s["t"] for s in tl.samples(since=3.5, until=4.0)] == [3.5, 4.0]


def test_coarser_steps_add_counts_and_keep_the_last_gauges():
    merged = coarsen([_sample(0.25, 1, 5), _sample(0.5, 2, 7), _sample(0.75, 4, 9), _sample(1.0, 8, 1)], 1.0)
    assert [(m["t"], m["counts"]["tenants"]["a"]["arrived"], m["gauges"]["queued"]) for m in merged] == [
        (0.75, 7, 9), (1.0, 8, 1)]


def test_a_recorded_file_reads_back_and_bad_files_say_why(tmp_path):
    tl = Timeline(0.25, 10.0, clock="virtual", source="test")
    for i in range(5):
        tl.append(_sample(i * 0.25, i, 0))
    path = tmp_path / "run.jsonl.gz"
    tl.write(path)
    back = Timeline.read(path)
    assert (back.step_s, back.clock, back.source, len(back)) == (0.25, "virtual", "test", 5)
    assert back.samples() == tl.samples()

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "something-else"}\n')
    with pytest.raises(TimelineFormatError, match="not a bouncer-timeline header"):
        Timeline.read(bad)
    with gzip.open(path, "rb") as f:
        lines = f.read().splitlines()
    bad.write_bytes(lines[0] + b"\n" + lines[1] + b"\n{oops\n")
    with pytest.raises(TimelineFormatError, match="line 3 is not JSON"):
        Timeline.read(bad)
    bad.write_bytes(lines[0].replace(b'"version":1', b'"version":9') + b"\n")
    with pytest.raises(TimelineFormatError, match="version 9"):
        Timeline.read(bad)


def test_the_recorder_config_is_bounded():
    ok = parse_config({**make_config(), "recorder": {"step_s": 1, "horizon_s": 3600}})
    assert ok.recorder.horizon_s == 3600
    with pytest.raises(ConfigError, match="at most 100000"):
        parse_config({**make_config(), "recorder": {"step_s": 0.05, "horizon_s": 86400}})
    with pytest.raises(ConfigError, match="recorder.step_s"):
        parse_config({**make_config(), "recorder": {"step_s": 0}})


# -- /admin/timeline on a real gateway ---------------------------------------------------------
def _get(url: str, key: str | None = "admin", timeout: float = 10.0):
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, resp.headers.get("Content-Type"), resp.read()


@pytest.fixture
def fleet(bg_loop):
    f = Fleet(bg_loop, [gw_tenant("t", 0)], engines=1)
    yield f
    f.close()


def _wait_samples(fleet, n: int) -> None:
    from servers import poll_until
    poll_until(lambda: fleet.call(lambda: len(fleet.gateway.recorder.timeline)) >= n, timeout=10,
               what=f"{n} timeline samples")


def test_admin_timeline_serves_json_jsonl_and_coarser_steps(fleet):
    _wait_samples(fleet, 8)
    status, ctype, body = _get(fleet.url + "/admin/timeline")
    data = json.loads(body)
    assert status == 200 and ctype.startswith("application/json")
    header, samples = data["header"], data["samples"]
    assert header["format"] == "bouncer-timeline" and header["step_s"] == 0.25 and header["live"] is True
    assert len(samples) >= 8 and header["bytes_held"] > 0
    ts = [s["t"] for s in samples]
    assert ts == sorted(ts) and all(0.2 < b - a < 0.4 for a, b in zip(ts, ts[1:], strict=False))
    assert set(samples[-1]["gauges"]["models"]["demo-llm"]["replicas"]) == {"e0"}
    assert samples[-1]["gauges"]["gateway"]["serving"] == 0

    _, _, body = _get(fleet.url + f"/admin/timeline?since={ts[2]}&until={ts[4]}")
    assert [s["t"] for s in json.loads(body)["samples"]] == ts[2:5]
    _, _, body = _get(fleet.url + "/admin/timeline?step=1")
    coarse = json.loads(body)
    assert coarse["header"]["step_s"] == 1.0 and len(coarse["samples"]) < len(samples)
    status, ctype, body = _get(fleet.url + "/admin/timeline?format=jsonl&last=1")
    lines = body.splitlines()
    assert ctype.startswith("application/x-ndjson") and json.loads(lines[0])["format"] == "bouncer-timeline"
    assert 3 <= len(lines) - 1 <= 6


@pytest.mark.parametrize("query, message", [("since=abc", "not a number"), ("last=-1", "last must be > 0"),
                                            ("since=5&until=1", "until is before since"),
                                            ("format=xml", "json or jsonl"), ("since=1&last=2", "not both")])
def test_admin_timeline_refuses_bad_queries_clearly(fleet, query, message):
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(fleet.url + "/admin/timeline?" + query)
    assert err.value.code == 400 and message in json.loads(err.value.read())["error"]["message"]


def test_the_timeline_needs_an_admin_or_viewer_key_and_the_page_does_not(fleet):
    for key in (None, "t", "wrong"):
        with pytest.raises(urllib.error.HTTPError) as err:
            _get(fleet.url + "/admin/timeline", key=key)
        assert err.value.code == 401
    status, ctype, body = _get(fleet.url + "/ui", key=None)
    assert status == 200 and ctype.startswith("text/html") and b"uPlot.iife.min.js" in body
    status, ctype, body = _get(fleet.url + "/ui/vendor/uPlot.iife.min.js", key=None)
    assert status == 200 and len(body) > 40_000
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(fleet.url + "/ui/..%2Fpage.py", key=None)
    assert err.value.code == 404

    # a viewer key reads the timeline and nothing else of /admin
    config = {**fleet.config, "access": {"viewer_keys_sha256": [key_digest("viewer")]}}
    req = urllib.request.Request(fleet.url + "/admin/reload", data=json.dumps(config).encode(), method="POST",
                                 headers={"Authorization": "Bearer admin", "Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=10).read()
    assert _get(fleet.url + "/admin/timeline?last=1", key="viewer")[0] == 200
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(fleet.url + "/admin/state", key="viewer")
    assert err.value.code == 401


def test_the_stream_sends_new_samples_as_they_are_taken(fleet):
    _wait_samples(fleet, 2)
    req = urllib.request.Request(fleet.url + "/admin/timeline?stream=1", headers={"Authorization": "Bearer admin"})
    events: list[tuple[str, dict]] = []

    def read() -> None:
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            event, data = "message", ""
            for raw in resp:
                line = raw.decode().rstrip("\n")
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:"):
                    data = line[5:].strip()
                elif not line and data:
                    events.append((event, json.loads(data)))
                    event, data = "message", ""
                    if len(events) >= 5:
                        return

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(15)
    assert not reader.is_alive()
    assert events[0][0] == "header" and events[0][1]["step_s"] == 0.25
    ts = [d["t"] for kind, d in events[1:]]
    assert len(ts) == 4 and ts == sorted(ts) and len(set(ts)) == 4


def test_a_reload_with_another_step_keeps_the_samples_and_recording_can_be_turned_off(fleet):
    _wait_samples(fleet, 6)

    def reload(recorder: dict) -> None:
        body = json.dumps({**fleet.config, "recorder": recorder}).encode()
        req = urllib.request.Request(fleet.url + "/admin/reload", data=body, method="POST",
                                     headers={"Authorization": "Bearer admin", "Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).read()

    before = fleet.call(lambda: len(fleet.gateway.recorder.timeline))
    reload({"step_s": 0.5, "horizon_s": 1.0})  # room for two
    tl = fleet.call(lambda: fleet.gateway.recorder.timeline)
    assert before > 2 and tl.step_s == 0.5 and len(tl) == 2
    reload({"enabled": False})
    with pytest.raises(urllib.error.HTTPError) as err:
        _get(fleet.url + "/admin/timeline")
    assert err.value.code == 404 and b"recorder_disabled" in err.value.read()


# -- the simulator records in the same format -------------------------------------------------
def test_a_simulated_run_records_every_attempt_and_the_report_links_the_file(tmp_path):
    from bouncer.bench.goodput import run, save, simulate
    from bouncer.bench.report import write_report

    tl = Timeline(0.5, float("inf"), clock="virtual", source="test")
    _, _, _, result = simulate("rogue-tenant", "bouncer", 2.0, 0, 2, 20.0, record=tl)
    samples = tl.samples()
    assert samples[0]["t"] == 0.0 and samples[-1]["t"] >= 20.0
    gaps = [b["t"] - a["t"] for a, b in zip(samples, samples[1:], strict=False)]
    assert gaps[:-1] == pytest.approx([0.5] * (len(gaps) - 1)) and 0 <= gaps[-1] <= 0.5  # the last: the run's end
    counts = [c for s in samples for c in s["counts"]["tenants"].values()]
    # each attempt is offered to the core once, and sampled once: the samples add up to the run
    assert sum(c.get("arrived", 0) for c in counts) == result.attempts
    assert sum(c.get("completed", 0) for c in counts) == result.outcomes["completed"]
    assert max(s["gauges"]["models"]["sim-llm"]["bands"].get("-1", {}).get("queued", 0) for s in samples) > 0
    with pytest.raises(ValueError, match="has none"):
        simulate("rogue-tenant", "vllm-queue-cap", 1.0, 0, 2, 5.0, record=Timeline(0.5, float("inf")))

    out = run("rogue-tenant", "bouncer", 1.0, replicas=2, duration_s=5.0)
    out["recording"] = str(tmp_path / "rogue.jsonl.gz")
    save(out, tmp_path / "r.json")
    report = write_report([str(tmp_path / "r.json")], str(tmp_path / "report")).read_text()
    assert "[rogue.jsonl.gz](../rogue.jsonl.gz)" in report and f"`bouncer recorder {out['recording']}`" in report
