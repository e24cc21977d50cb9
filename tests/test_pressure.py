"""Outside pressure (`pressure:`): a polled signal sheds its bands and tenants while it is high,
with hysteresis, and as configured while it is stale. First the core with explicit time, then
the gateway polling a real file and a real HTTP endpoint."""

from __future__ import annotations

import calendar
import json
import time
import types

import pytest
from aiohttp import web

from bouncer.config import PressureSource, parse_config
from bouncer.core.admission import AdmissionCore
from bouncer.core.outcomes import Reason, Terminal
from bouncer.gateway.pressure_feeds import UnreadableSignal, parse_value, scheduled_value
from conftest import _serve_on_loopback
from core_helpers import dispatched, info, make_config, observe_idle, rejected, tenant
from gateway_setup import Fleet
from gateway_setup import tenant as gw_tenant
from servers import free_port, poll_until

CARBON = {"name": "carbon", "source": {"kind": "schedule", "schedule": [{"at": "00:00", "value": 0}]},
          "poll_s": 30, "stale_s": 120, "shed_above": 400, "resume_below": 350, "bands": [-1]}


def _core(**signal) -> AdmissionCore:
    cfg = make_config(tenants=[tenant("free", priority=-1), tenant("paid")])
    cfg["pressure"] = [{**CARBON, **signal}]
    core = AdmissionCore(parse_config(cfg), 0.0)
    observe_idle(core, 0.0)
    return core


def _outcome(core: AdmissionCore, who: str, now: float):
    observe_idle(core, now)  # fresh telemetry: only the pressure can refuse
    events = core.offer(info(who, prompt=50, max_tokens=10), now)
    if dispatched(events):
        core.finished(dispatched(events)[0].request_id, now, Terminal.COMPLETED)
        return "admitted"
    return rejected(events)[0].refusal


def test_high_sheds_the_band_until_below_resume_with_hysteresis():
    core = _core()
    assert _outcome(core, "free", 1.0) == "admitted"  # no value yet: stale, fail-open
    core.observe_pressure("carbon", 450, 2.0)
    refusal = _outcome(core, "free", 2.0)
    assert refusal.reason == Reason.OUTSIDE_PRESSURE and refusal.status == 503 and refusal.retry_after == 30
    assert "carbon is 450, above 400" in refusal.message
    assert _outcome(core, "paid", 2.0) == "admitted"  # band 0 is not named
    core.observe_pressure("carbon", 380, 3.0)  # under shed_above, over resume_below: still shed
    assert _outcome(core, "free", 3.0).reason == Reason.OUTSIDE_PRESSURE
    core.observe_pressure("carbon", 340, 4.0)
    assert _outcome(core, "free", 4.0) == "admitted"
    core.observe_pressure("carbon", 380, 5.0)  # rising again, not above shed_above: not shed
    assert _outcome(core, "free", 5.0) == "admitted"
    core.observe_pressure("carbon", 900, 4.5)  # older than what is held: ignored
    assert _outcome(core, "free", 5.0) == "admitted"


def test_a_stale_value_fails_open_or_closed_as_configured():
    opened = _core()
    opened.observe_pressure("carbon", 450, 0.0)
    assert _outcome(opened, "free", 100.0).reason == Reason.OUTSIDE_PRESSURE
    assert _outcome(opened, "free", 121.0) == "admitted"  # 121 s old: stale, fail-open
    closed = _core(on_stale="fail-closed")
    refusal = _outcome(closed, "free", 1.0)  # before the first poll: shed
    assert refusal.reason == Reason.OUTSIDE_PRESSURE and "no fresh value" in refusal.message
    closed.observe_pressure("carbon", 100, 2.0)
    assert _outcome(closed, "free", 2.0) == "admitted"
    assert _outcome(closed, "free", 123.0).reason == Reason.OUTSIDE_PRESSURE  # stale again
    assert _outcome(closed, "paid", 123.0) == "admitted"


def test_named_tenants_are_shed_and_a_reload_keeps_the_value():
    core = _core(bands=[], tenants=["paid"])
    core.observe_pressure("carbon", 450, 1.0)
    assert _outcome(core, "paid", 1.0).reason == Reason.OUTSIDE_PRESSURE
    assert _outcome(core, "free", 1.0) == "admitted"
    cfg = make_config(tenants=[tenant("free", priority=-1), tenant("paid")])
    cfg["pressure"] = [{**CARBON, "bands": [], "tenants": ["paid"], "shed_above": 500, "resume_below": 500}]
    core.reload(parse_config(cfg), 2.0)
    assert _outcome(core, "paid", 2.0) == "admitted"  # 450 judged again: under the new threshold


def test_bad_pressure_configs_are_refused():
    base = make_config(tenants=[tenant("free", priority=-1)])
    for bad, words in (({"bands": []}, "bands or tenants"), ({"resume_below": 500}, "resume_below"),
                       ({"tenants": ["nobody"]}, "unknown tenant"),
                       ({"source": {"kind": "http", "url": "ftp://x"}}, "http:// or https://"),
                       ({"source": {"kind": "file"}}, "needs path")):
        with pytest.raises(ValueError, match=words):
            parse_config({**base, "pressure": [{**CARBON, **bad}]})


def test_sources_read_numbers_fields_timestamps_and_schedules():
    number = PressureSource(kind="file", path="x")
    assert parse_value(" 412.5\n", number, 0.0) == (412.5, 0.0)
    with pytest.raises(UnreadableSignal, match="not a number"):
        parse_value("high", number, 0.0)
    nested = PressureSource(kind="http", url="http://x", field="data.intensity", timestamp_field="data.at")
    assert parse_value(json.dumps({"data": {"intensity": "301", "at": 990.0}}), nested, 1000.0) == (301.0, 10.0)
    with pytest.raises(UnreadableSignal, match="no field"):
        parse_value(json.dumps({"data": {}}), nested, 0.0)
    schedule = PressureSource(kind="schedule", schedule=[{"at": "08:00", "value": 500}, {"at": "20:00", "value": 100}])
    day = calendar.timegm((2026, 12, 2, 0, 0, 0))
    assert scheduled_value(schedule, day + 7 * 3600) == 100  # before the first point: the day's last
    assert scheduled_value(schedule, day + 8 * 3600) == 500
    assert scheduled_value(schedule, day + 21 * 3600) == 100


# -- the gateway polling real sources ------------------------------------------------------------

def _post(fleet: Fleet, key: str) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "demo-llm", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(fleet.url + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, {}
    except urllib.error.HTTPError as err:
        return err.code, {**dict(err.headers), "body": json.loads(err.read())}


def test_the_gateway_sheds_within_one_poll_of_a_file_and_an_http_feed(bg_loop, tmp_path):
    feed = {"data": {"intensity": 100}}

    def make_feed():
        app = web.Application()

        async def now(_request):
            return web.json_response(feed)
        app.router.add_get("/now", now)
        app.router.add_get("/health", now)
        return types.SimpleNamespace(app=lambda: app)  # what _serve_on_loopback serves
    feed_url, _, feed_cleanup = _serve_on_loopback(bg_loop, make_feed, free_port())
    price = tmp_path / "price"
    price.write_text("10")
    pressure = [
        {"name": "carbon", "source": {"kind": "http", "url": feed_url + "/now", "field": "data.intensity"},
         "poll_s": 0.2, "stale_s": 60, "shed_above": 400, "resume_below": 350, "bands": [-1]},
        {"name": "price", "source": {"kind": "file", "path": str(price)}, "poll_s": 0.2, "stale_s": 60,
         "shed_above": 50, "tenants": ["batch"]},
    ]
    f = Fleet(bg_loop, [gw_tenant("free", priority=-1), gw_tenant("batch"), gw_tenant("paid")], engines=1, speed=8.0)
    try:
        from conftest import start_gateway

        base, gw, cleanup = start_gateway(bg_loop, {**f.config, "pressure": pressure})
        f.url = base
        try:
            poll_until(lambda: bg_loop.call(lambda: all(s.value is not None for s in gw.core.pressures.values())),
                       what="both signals read")
            assert [_post(f, k)[0] for k in ("free", "batch", "paid")] == [200, 200, 200]
            feed["data"]["intensity"] = 450
            price.write_text("80")
            t0 = time.monotonic()
            poll_until(lambda: _post(f, "free")[0] == 503 and _post(f, "batch")[0] == 503, timeout=5,
                       what="both shed")
            assert time.monotonic() - t0 < 1.0  # within a poll or two (0.2 s)
            code, headers = _post(f, "free")
            assert headers["body"]["error"]["code"] == "outside_pressure" and headers["Retry-After"] == "1"
            assert _post(f, "paid")[0] == 200
            from urllib.request import urlopen
            with urlopen(base + "/metrics", timeout=10) as resp:
                metrics = resp.read().decode()
            assert 'bouncer_pressure_value{signal="carbon"} 450.0' in metrics
            assert 'bouncer_pressure_shedding{signal="price"} 1.0' in metrics
            feed["data"]["intensity"] = 300
            price.write_text("20")
            poll_until(lambda: _post(f, "free")[0] == 200 and _post(f, "batch")[0] == 200, timeout=5,
                       what="both back")
        finally:
            cleanup()
    finally:
        f.close()
        feed_cleanup()
