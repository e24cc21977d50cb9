"""Each admission layer's decisions, with explicit `now`."""

from __future__ import annotations

import pytest

from bouncer.config import parse_config
from bouncer.core.admission import AdmissionCore
from bouncer.core.fleet.replica import Telemetry
from bouncer.core.outcomes import Layer, Terminal
from core_helpers import admission_of, dispatched, info, make_config, make_core, observe_idle, tenant


def only_reject(events):
    assert len(events) == 1 and not dispatched(events), events
    return events[0].refusal


# -- layer 1 ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,status,reason,param", [
    ({"tenant_name": "nobody"}, 401, "unauthenticated", None),
    ({"model": "gpt-9"}, 404, "model_not_found", "model"),
    ({"n": 3}, 400, "invalid_parameter", "n"),
    ({"best_of": 4}, 400, "invalid_parameter", "best_of"),
    ({"num_stop": 9}, 400, "invalid_parameter", "stop"),
    ({"max_tokens": 0}, 400, "invalid_parameter", "max_tokens"),
    ({"prompt": 0}, 400, "invalid_parameter", "prompt"),
])
def test_validation_refusals(kwargs, status, reason, param):
    core = make_core()
    r = only_reject(core.offer(info(**kwargs), 0.0))
    assert (r.status, r.reason, r.layer, r.param) == (status, reason, Layer.VALIDATION, param)
    assert r.retry_after is None  # not an overload: do not retry


def test_model_not_allowed_for_tenant():
    core = AdmissionCore(parse_config(make_config(tenants=[tenant("a", models=["m"])])), 0.0)
    cfg = make_config(tenants=[tenant("a", models=["m"])])
    cfg["models"].append({"name": "other", "backends": [{"url": "http://127.0.0.1:9100"}]})
    core = AdmissionCore(parse_config(cfg), 0.0)
    observe_idle(core, 0.0)
    r = only_reject(core.offer(info(model="other"), 0.0))
    assert (r.status, r.reason) == (403, "model_not_allowed")


# -- layer 2 ----------------------------------------------------------------------------------------
def test_context_budget_refuses_and_clamps():
    core = make_core(tenants=[tenant("a", max_tokens_default=300, max_tokens_cap=1000)], max_model_len=2048)
    r = only_reject(core.offer(info(prompt=2048, max_tokens=None), 0.0))
    assert (r.status, r.reason, r.layer) == (400, "context_length_exceeded", Layer.CONTEXT)
    r = only_reject(core.offer(info(prompt=1500, max_tokens=800), 0.0))
    assert r.reason == "context_length_exceeded" and r.param == "max_tokens"
    # default max_tokens is clamped to what the context leaves
    (d,) = dispatched(core.offer(info(prompt=1900, max_tokens=None), 0.0))
    assert d.max_tokens == 148
    # an ask above the tenant cap is clamped to the cap, not refused
    (d,) = dispatched(core.offer(info(prompt=10, max_tokens=5000), 0.0))
    assert d.max_tokens == 1000
    (d,) = dispatched(core.offer(info(prompt=10, max_tokens=None), 0.0))
    assert d.max_tokens == 300


# -- rate limits and breaker ---------------------------------------------------------------------------
def test_request_rate_limit_refuses_with_retry_after():
    core = make_core(tenants=[tenant("a", rate_limit={"requests_per_s": 2, "request_burst": 2})])
    assert dispatched(core.offer(info(), 0.0)) and dispatched(core.offer(info(), 0.0))
    r = only_reject(core.offer(info(), 0.0))
    assert (r.status, r.reason, r.layer) == (429, "rate_limited_requests", Layer.RATE)
    assert r.retry_after == pytest.approx(0.5)  # the time to refill one request
    assert dispatched(core.offer(info(), 0.5))


def test_token_rate_limit():
    core = make_core(tenants=[tenant("a", rate_limit={"tokens_per_min": 6000, "token_burst": 1000})])
    assert dispatched(core.offer(info(prompt=400, max_tokens=400), 0.0))
    r = only_reject(core.offer(info(prompt=400, max_tokens=400), 0.0))
    assert r.reason == "rate_limited_tokens"
    assert r.retry_after == 6  # needs 600 more tokens at 100/s


def test_breaker_opens_on_timeouts_then_probes():
    core = make_core(policy={"breaker": {"failures": 2, "window_s": 10, "open_s": 5}})
    for t in (0.0, 1.0):
        (d,) = dispatched(core.offer(info(), t))
        core.finished(d.request_id, t + 0.5, Terminal.FAILED, reason="upstream_timeout")
    r = only_reject(core.offer(info(), 2.0))
    assert (r.status, r.reason) == (429, "circuit_open") and r.retry_after == pytest.approx(4.5)
    observe_idle(core, 7.0)
    (probe,) = dispatched(core.offer(info(), 7.0))  # half-open: one probe goes through
    assert only_reject(core.offer(info(), 7.1)).reason == "circuit_open"
    core.finished(probe.request_id, 7.5, Terminal.COMPLETED, completion_tokens=10)
    assert dispatched(core.offer(info(), 7.6))  # closed again


# -- layer 3: KV holds -------------------------------------------------------------------------------
def test_kv_full_replica_holds_then_dispatches_on_finish():
    # 1 replica of 100 blocks; each request reserves (100 + 100)/16 = 13 blocks
    core = make_core(replicas=1, kv_blocks=100, policy={"kv_busy_threshold": 0.9, "kv_resume_threshold": 0.5,
                                                        "saturation": {"kv_threshold": 1.0}})
    admitted = []
    for _i in range(10):
        admitted += dispatched(core.offer(info(), 0.0))
    assert len(admitted) == 6  # 6 x 13 = 78 blocks; a 7th would pass 90
    assert core.view.queued == 4
    # one finishing is not enough: hysteresis keeps the replica busy until usage < 0.5
    core.finished(admitted[0].request_id, 1.0, Terminal.COMPLETED, completion_tokens=100)
    ev = []
    for a in admitted[1:3]:
        ev += core.finished(a.request_id, 1.0, Terminal.COMPLETED, completion_tokens=100)
    assert dispatched(ev)


def _banded_core(**policy):
    """One replica of 1,000 blocks (each request here holds 13), a top band with a TTFT SLO
    above band 0, marked busy at 0.9 and usable again under 0.5."""
    return make_core(replicas=1, kv_blocks=1000,
                     tenants=[tenant("top", priority=10, slo={"ttft_s": 5.0}), tenant("low"),
                              tenant("mid", priority=5)],
                     policy={"kv_busy_threshold": 0.9, "kv_resume_threshold": 0.5,
                             "saturation": {"kv_threshold": 1.0}, "default_ttl_s": 60, **policy})


def test_the_top_band_fills_a_replica_past_its_busy_mark_and_lower_bands_stop_at_it():
    core = _banded_core()  # top_band_kv_threshold: 0.97 by default
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.91, running=10, waiting=0), 0.0)
    assert core.offer(info("low"), 0.0) == []  # busy: band 0 waits
    # the top band goes past the mark, to 0.97: 0.91 + 4 x 0.013 = 0.962, a fifth would pass it
    top = [d for _ in range(6) for d in dispatched(core.offer(info("top"), 0.0))]
    assert len(top) == 4 and {d.tenant for d in top} == {"top"}
    assert core.view.queued == 3  # the low request and two of the top band's
    # a band above 0 is held at the mark while a higher band sends, and goes past it once that
    # band has been quiet for longer than BAND_ACTIVE_S (10 s)
    fresh = _banded_core()
    fresh.observe("m/0", Telemetry(at=0.0, kv_usage=0.91, running=10, waiting=0), 0.0)
    assert dispatched(fresh.offer(info("top"), 0.0))
    assert fresh.offer(info("mid"), 0.0) == []
    fresh.observe("m/0", Telemetry(at=11.0, kv_usage=0.91, running=10, waiting=0), 11.0)
    assert [d.tenant for d in dispatched(fresh.offer(info("mid"), 11.0))] == ["mid"]


def test_a_top_band_kv_threshold_at_the_busy_mark_holds_the_top_band_there_too():
    core = _banded_core(top_band_kv_threshold=0.9)
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.91, running=10, waiting=0), 0.0)
    assert core.offer(info("top"), 0.0) == []
    # below kv_busy_threshold it means kv_busy_threshold
    core = _banded_core(top_band_kv_threshold=0.5)
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.85, running=10, waiting=0), 0.0)
    assert len(dispatched(core.offer(info("top"), 0.0))) == 1  # 0.85 + 0.013, under 0.9


def _rising(core, until: float, start: float = 0.2, per_s: float = 0.05) -> float:
    """The replica's KV scraped every half second, rising `per_s` a second: the usage at `until`."""
    t = 0.0
    while t <= until:
        core.observe("m/0", Telemetry(at=t, kv_usage=start + per_s * t, running=10, waiting=0), t)
        t += 0.5
    return start + per_s * until


def test_a_lower_band_leaves_the_top_band_the_kv_that_what_runs_there_is_growing_into():
    """While the top band sends, a lower band's request waits where the KV, rising as it has
    lately, would pass the top band's limit before its own answer is done; it goes once the
    KV holds still. The top band is not held so, nor a band with none above it sending."""
    slow = {"step_time": {"a": 0.1, "b": 0.0, "c": 0.0, "max_batched_tokens": 8192}}  # 0.1 s a token

    def banded(**policy):
        core = make_core(replicas=1, kv_blocks=1000, model=slow, fresh=False,
                         tenants=[tenant("top", priority=10, slo={"ttft_s": 5.0}), tenant("low")],
                         policy={"kv_busy_threshold": 0.9, "kv_resume_threshold": 0.5,
                                 "saturation": {"kv_threshold": 1.0}, "default_ttl_s": 60, **policy})
        core.observe("m/0", Telemetry(at=0.0, kv_usage=0.2, running=10, waiting=0), 0.0)
        assert dispatched(core.offer(info("low", max_tokens=2000), 0.0))  # something of ours runs there
        return core

    core = banded()
    usage = _rising(core, 8.0)  # 0.6, rising 0.05 a second
    assert [d.tenant for d in dispatched(core.offer(info("top", max_tokens=2000), 8.0))] == ["top"]
    # its answer: 256 tokens expected (the default) at 0.1 s each, 25.6 s; at the KV's recent
    # rise (0.043 a second, smoothed) it would pass the top band's 0.97 well before that
    assert core.offer(info("low", max_tokens=2000), 8.0) == []
    assert usage < 0.9 and core.view.queued == 1
    # the KV holds still: its trend fades, and the request goes
    sent = []
    for t in range(9, 31):
        sent += dispatched(core.observe("m/0", Telemetry(at=t, kv_usage=usage, running=10, waiting=0), t))
    assert [d.tenant for d in sent] == ["low"]

    # with no band above it sending, the same rise holds nothing back
    alone = banded()
    _rising(alone, 8.0)
    assert [d.tenant for d in dispatched(alone.offer(info("low", max_tokens=2000), 8.0))] == ["low"]

    # nor a trend read from scrapes that stopped coming (where a stale replica is still used)
    stale = banded(telemetry={"on_stale": "fail-open"})
    _rising(stale, 8.0)
    later = 8.0 + stale.config.policy.telemetry.staleness_s + 0.1
    assert dispatched(stale.offer(info("top", max_tokens=2000), later))
    assert [d.tenant for d in dispatched(stale.offer(info("low", max_tokens=2000), later))] == ["low"]


def test_the_top_band_is_squeezed_for_context_from_its_own_kv_limit():
    """Long requests wait while the pool is under pressure (`context_pressure_start`); under the
    busy mark, the band let past it counts its pressure from as far under its own limit, so a
    long prompt of the top band goes into a pool at 0.88 where one of a lower band waits. Past
    the mark (its own headroom), it is squeezed as every band is."""
    core = make_core(replicas=1, kv_blocks=10000, fresh=False,
                     tenants=[tenant("top", priority=10, slo={"ttft_s": 5.0}), tenant("low")],
                     policy={"kv_busy_threshold": 0.92, "top_band_kv_threshold": 0.97, "kv_reservation": "reserve",
                             "saturation": {"kv_threshold": 1.0}, "default_ttl_s": 600})
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.0, running=0, waiting=0), 0.0)

    def sent(events):  # dispatched, and decoding at once (no prefill left queued)
        out = dispatched(events)
        for d in out:
            core.started(d.request_id, 0.0)
        return out

    filler = [d for _ in range(88) for d in sent(core.offer(info("low", prompt=1500, max_tokens=100), 0.0))]
    assert len(filler) == 88 and core.replicas["m/0"].inflight_blocks == 8800  # 0.88 of the pool
    # 5,000 + 1,024 tokens: at 0.88 the squeeze from 0.8 leaves 5,734 of 8,192 (held); from
    # 0.85 (0.8 plus the top band's 0.05 past the busy mark), 7,270
    assert [d.tenant for d in sent(core.offer(info("top", prompt=5000, max_tokens=1024), 0.0))] == ["top"]
    assert sent(core.offer(info("low", prompt=5000, max_tokens=1024), 0.0)) == []
    # a short request of the top band takes the pool past the busy mark, to 0.93
    assert sent(core.offer(info("top", prompt=1868, max_tokens=100), 0.0))
    assert core.replicas["m/0"].inflight_blocks == 9300
    # 4,000 + 1,000 tokens (it would fit under 0.97): at 0.93 the squeeze leaves 4,198 (counted
    # from 0.88, 5,734)
    assert sent(core.offer(info("top", prompt=4000, max_tokens=1000), 0.0)) == []


def test_scraped_usage_counts_even_when_own_accounting_is_low():
    core = make_core(replicas=1, kv_blocks=1000)
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.95, running=10, waiting=0), 0.0)
    assert dispatched(core.offer(info(), 0.0)) == []  # held: the engine says it is full
    ev = core.observe("m/0", Telemetry(at=1.0, kv_usage=0.3, running=5, waiting=0), 1.0)
    assert len(dispatched(ev)) == 1


def test_reserve_policy_reserves_max_tokens():
    core = make_core(replicas=1, kv_blocks=1000, policy={"kv_reservation": "reserve"})
    (d,) = dispatched(core.offer(info(prompt=100, max_tokens=1500), 0.0))
    assert admission_of(core, d).expected_output == 1500 and admission_of(core, d).blocks == 100
    core2 = make_core(replicas=1, kv_blocks=1000, policy={"expected_output_default": 200})
    (d,) = dispatched(core2.offer(info(prompt=100, max_tokens=1500), 0.0))
    assert admission_of(core2, d).expected_output == 200


def test_expected_output_is_learned():
    core = make_core(replicas=1, kv_blocks=100000)
    for _ in range(20):
        (d,) = dispatched(core.offer(info(max_tokens=2000), 0.0))
        core.finished(d.request_id, 1.0, Terminal.COMPLETED, completion_tokens=50)
    (d,) = dispatched(core.offer(info(max_tokens=2000), 2.0))
    assert 50 <= admission_of(core, d).expected_output < 60


def test_tenant_kv_share_is_reserved_but_lent_when_idle():
    tenants = [tenant("vip", priority=0, kv_share=0.5), tenant("bulk", priority=0)]
    core = make_core(tenants=tenants, replicas=1, kv_blocks=160,
                     policy={"kv_busy_threshold": 1.0, "kv_resume_threshold": 1.0, "saturation": {"kv_threshold": 1.0}})
    # bulk may use only the unreserved half while vip is idle: 160*1.0 - 80 = 80 blocks = 6 x 13
    bulk = []
    for _ in range(10):
        bulk += dispatched(core.offer(info("bulk"), 0.0))
    assert len(bulk) == 6
    # vip gets its reserved half at once
    vip = []
    for _ in range(6):
        vip += dispatched(core.offer(info("vip"), 0.0))
    assert len(vip) == 6


def test_context_cap_tightens_under_pressure():
    core = make_core(tenants=[tenant("a", context_cap=4000, max_tokens_cap=4000)], replicas=1, kv_blocks=1000,
                     policy={"context_pressure_start": 0.5, "context_pressure_min_fraction": 0.25})
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.75, running=10, waiting=0), 0.0)
    # pressure 0.75 is halfway from 0.5 to 1.0: cap = 4000 x (1 - 0.75 x 0.5) = 2500
    assert dispatched(core.offer(info(prompt=2000, max_tokens=400), 0.0))
    assert not dispatched(core.offer(info(prompt=2000, max_tokens=1000), 0.0))
    assert core.view.queued == 1


# -- layers 4 and 5 -----------------------------------------------------------------------------------
def _full_core(**policy):
    # a replica that is full: everything queues
    core = make_core(replicas=1, kv_blocks=1000, policy=policy,
                     tenants=[tenant("a"), tenant("b"), tenant("free", priority=-1), tenant("vip", priority=5)])
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.99, running=50, waiting=0), 0.0)
    return core


def test_arrival_behind_its_tenants_head_reruns_the_loop_only_when_its_last_run_is_stale():
    from bouncer.core.arrivals import LOOP_FRESH_S

    core = _full_core()
    ms = core.models["m"]
    assert core.offer(info("a"), 1.0) == []  # the head of a's queue: the loop runs for it
    assert ms.looped_at == 1.0
    assert core.offer(info("a"), 1.001) == []  # behind a's head, the loop fresh: not run again
    assert ms.looped_at == 1.0
    assert core.offer(info("b"), 1.002) == []  # b's head may go: run
    assert ms.looped_at == 1.002
    later = 1.002 + 2 * LOOP_FRESH_S
    assert core.offer(info("a"), later) == []  # behind a's head, but the last run is stale: run
    assert ms.looped_at == later
    assert core.view.queued == 4


def test_tenant_queue_bound_is_tenant_caused_429():
    core = _full_core(queues={"tenant_max_requests": 2})
    assert core.offer(info("a"), 0.0) == [] and core.offer(info("a"), 0.0) == []
    r = only_reject(core.offer(info("a"), 0.0))
    assert (r.status, r.reason, r.layer) == (429, "tenant_queue_full", Layer.QUEUE)
    assert r.retry_after > 0
    assert core.offer(info("b"), 0.0) == []  # other tenants still queue


def test_full_waiting_room_is_529_and_evicts_sheddable_for_higher_priority():
    core = _full_core(queues={"max_requests": 3}, sheddable_ceiling=2.0)
    for _ in range(2):
        assert core.offer(info("free"), 0.0) == []
    assert core.offer(info("a"), 0.0) == []
    ev = core.offer(info("b"), 0.0)  # room is full: the newest sheddable request is evicted
    (ev,) = ev
    assert ev.terminal is Terminal.EVICTED and ev.refusal.status == 529 and ev.tenant == "free"
    assert core.view.queued == 3
    core.offer(info("free"), 0.0)  # a sheddable newcomer cannot evict its own band
    r = only_reject(core.offer(info("free"), 0.0))
    assert (r.status, r.reason) == (529, "queue_full")


def test_sheddable_refused_at_once_when_saturated():
    core = _full_core()
    r = only_reject(core.offer(info("free"), 0.0))
    assert (r.status, r.reason, r.layer) == (529, "saturated", Layer.FLOW)
    assert core.offer(info("a"), 0.0) == []  # non-sheddable traffic waits instead


def test_sheddable_prefill_alone_does_not_hold_other_bands():
    # one replica, room for one engine step of queued prefill (8,192 tokens)
    core = make_core(replicas=1, kv_blocks=100_000, policy={"prefill_busy_tokens": 8192},
                     tenants=[tenant("a"), tenant("free", priority=-1)])
    assert dispatched(core.offer(info("free", prompt=6000, max_tokens=16), 0.0))
    # a regular request would wait for that prefill in the engine or in the gateway alike: it goes
    assert dispatched(core.offer(info("a", prompt=4000, max_tokens=16), 0.0))
    # behind a regular request's prefill the queue is full, for every band
    assert core.offer(info("a", prompt=4000, max_tokens=16), 0.0) == []
    assert core.offer(info("free", prompt=4000, max_tokens=16), 0.0) == []


def test_sheddable_prefill_holds_sheddable_requests():
    core = make_core(replicas=1, kv_blocks=100_000, policy={"prefill_busy_tokens": 8192},
                     tenants=[tenant("a"), tenant("free", priority=-1)])
    assert dispatched(core.offer(info("free", prompt=6000, max_tokens=16), 0.0))
    assert core.offer(info("free", prompt=4000, max_tokens=16), 0.0) == []


def test_ttl_expiry_and_client_ttl():
    core = _full_core(default_ttl_s=10)
    assert core.offer(info("a"), 0.0) == []
    assert core.offer(info("b", ttl_s=2.0), 0.0) == []
    assert core.next_wakeup() == 2.0
    (e,) = core.tick(2.0)
    assert e.terminal is Terminal.EXPIRED and e.refusal.status == 503 and e.refusal.reason == "ttl_expired"
    assert e.refusal.retry_after > 0
    assert core.tick(9.9) == []
    (e,) = core.tick(10.0)
    assert e.tenant == "a"


def test_higher_band_dispatches_first():
    core = _full_core()
    core.offer(info("a"), 0.0)
    core.offer(info("vip"), 0.0)
    ev = core.observe("m/0", Telemetry(at=1.0, kv_usage=0.0, running=0, waiting=0), 1.0)
    assert [d.tenant for d in dispatched(ev)] == ["vip", "a"]


def test_stale_telemetry_fail_closed_vs_fail_open():
    closed = make_core(fresh=False, policy={"telemetry": {"staleness_s": 2.0, "on_stale": "fail-closed"}})
    r = only_reject(closed.offer(info(), 0.0))
    assert (r.status, r.reason) == (503, "no_backend")
    opened = make_core(fresh=False, policy={"telemetry": {"staleness_s": 2.0, "on_stale": "fail-open"}})
    assert dispatched(opened.offer(info(), 0.0))
    # fresh then stale: fail-closed holds queued work instead of sending it blind
    core = make_core(replicas=1)
    assert dispatched(core.offer(info(), 0.0))
    assert only_reject(core.offer(info(), 5.0)).reason == "no_backend"


def test_failed_scrape_makes_replica_unusable():
    core = make_core(replicas=2)
    core.observe("m/0", None, 0.0)
    for _ in range(4):
        (d,) = dispatched(core.offer(info(), 0.0))
        assert d.replica == "m/1"


def test_drain_queues_up_to_cap_then_503_and_undrain_dispatches():
    core = make_core(policy={"drain_queue_cap": 2})
    core.drain("m")
    assert core.offer(info(), 0.0) == [] and core.offer(info(), 0.0) == []
    r = only_reject(core.offer(info(), 0.0))
    assert (r.status, r.reason) == (503, "draining")
    assert len(dispatched(core.undrain("m", 1.0))) == 2


def test_retry_after_grows_with_backlog():
    core = _full_core(queues={"tenant_max_requests": 1000})
    # a measured service rate: 30 completions in the 30 s window -> 1 request/s
    for i in range(30):
        core.observe("m/0", Telemetry(at=float(i), kv_usage=0.0, running=0, waiting=0), float(i))
        for d in dispatched(core.offer(info("a", prompt=500, max_tokens=500), float(i))):
            core.finished(d.request_id, float(i), Terminal.COMPLETED, completion_tokens=500)
    core.observe("m/0", Telemetry(at=30.0, kv_usage=0.99, running=50, waiting=0), 30.0)
    retry = []
    for _n in range(4):
        for _ in range(10):
            core.offer(info("a", prompt=200, max_tokens=10), 30.0)
        retry.append(core.models["m"].backlog.retry_after(0, 30.0))
    assert retry == sorted(retry) and retry[-1] > retry[0] * 3
    assert retry[0] == pytest.approx(10, abs=1)  # 10 queued ahead at 1 completion per second


def test_a_light_tenant_is_not_refused_for_a_heavy_tenants_backlog():
    # queueing budget 2 s (half a 4 s TTFT SLO), about 1 completion/s
    core = make_core(replicas=1, kv_blocks=1000, policy={"slo_queue_fraction": 0.5},
                     tenants=[tenant("light", slo={"ttft_s": 4.0}), tenant("heavy", slo={"ttft_s": 4.0})])
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.99, running=50, waiting=0), 0.0)
    for t in range(-27, 3):  # a measured service rate: about 1 completion/s
        core.stores.backlog.note_completion("m", float(t))
    heavy = [core.offer(info("heavy"), 2.0) for _ in range(6)]
    assert heavy[:2] == [[], []]  # queued: 1 and 2 requests ahead fit 2 s
    assert all(e and e[0].refusal.reason == "deadline_infeasible" for e in heavy[2:])
    # 'light' has nothing queued: under fair queueing its request waits for one turn of each
    # active tenant (2 slots), not behind all of heavy's backlog
    assert core.offer(info("light"), 2.0) == []


def test_queued_request_expires_with_its_ttft_slo_and_infeasible_ones_are_refused():
    core = make_core(replicas=1, kv_blocks=1000, policy={"default_ttl_s": 60, "slo_queue_fraction": 0.5},
                     tenants=[tenant("a", slo={"ttft_s": 2.0}), tenant("b")])
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.99, running=50, waiting=0), 0.0)
    assert core.offer(info("a"), 0.0) == []
    assert core.next_wakeup() == 1.0  # its TTL is half its 2 s TTFT SLO, not the 60 s default
    # measured drain rate of 1 request/s, and 5 queued ahead: a 2 s TTFT cannot be met
    for t in range(-28, 2):  # 30 in the last 30 s
        core.stores.backlog.note_completion("m", float(t))
    for _ in range(4):
        core.offer(info("b"), 1.0)
    (r,) = core.offer(info("a"), 1.0)
    assert (r.refusal.status, r.refusal.reason, r.refusal.layer.value) == (429, "deadline_infeasible", "slo")
    # Under fair queueing, tenant a's 2 queued requests (itself included) drain at half the band's
    # rate (a and b are active, equal weights): 4 request-slots at 30 completions in 29 s. Back
    # once the wait fits its 1 s budget.
    assert r.refusal.retry_after == pytest.approx(2 * 2 / (30 / 29) - 1)
    assert core.view.queued == 5  # the refused one left the queue


def test_eviction_takes_the_lowest_band_first_then_its_newest_request():
    core = make_core(replicas=1, kv_blocks=1000, policy={"queues": {"max_requests": 4}, "sheddable_ceiling": 5.0},
                     tenants=[tenant("a"), tenant("low", priority=-1), tenant("lowest", priority=-2)])
    core.observe("m/0", Telemetry(at=0.0, kv_usage=0.99, running=50, waiting=0), 0.0)
    low_old, low_new, lowest_old, lowest_new = (info("low"), info("low"), info("lowest"), info("lowest"))
    for r in (low_old, lowest_old, low_new, lowest_new):
        assert core.offer(r, 0.0) == []
    order = []
    for _ in range(4):
        (e,) = core.offer(info("a"), 0.0)
        order.append(e.request_id)
    assert order == [lowest_new.request_id, lowest_old.request_id, low_new.request_id, low_old.request_id]
    r = only_reject(core.offer(info("a"), 0.0))  # nothing sheddable left to evict
    assert r.reason == "queue_full"


def test_a_band_s_reserve_is_its_tenants_configured_slo_not_a_request_s_header():
    """A refused probe with a 1 ms TTFT header from the top band leaves the reserve the lower
    bands keep at the top tenant's configured SLO (issue 67, finding 5)."""
    core = make_core(tenants=[tenant("top", 10, slo={"ttft_s": 2.0}), tenant("low", 0)])
    core.offer(info("top", ttft_slo_s=0.001), 0.0)
    assert core.models["m"].band_slos.protected(0, 0.1) == (2.0, float("inf"))


def test_n_and_best_of_are_charged_and_held_per_sequence():
    """`n` answers (or `best_of` candidates) cost their tenant's token bucket and hold KV as that
    many answers, not one (issue 67: n and best_of were not multiplied into charges)."""
    core = make_core(tenants=[tenant("a", rate_limit={"tokens_per_min": 1e9})], limits={"max_n": 4, "max_best_of": 4})
    one = admission_of(core, dispatched(core.offer(info("a", prompt=100, max_tokens=50), 0.0))[0])
    four = admission_of(core, dispatched(core.offer(info("a", prompt=100, max_tokens=50, n=4), 0.0))[0])
    best = admission_of(core, dispatched(core.offer(info("a", prompt=100, max_tokens=50, best_of=3), 0.0))[0])
    assert (one.rate_charge, four.rate_charge, best.rate_charge) == (150, 300, 250)
    assert four.expected_output == 4 * one.expected_output and best.expected_output == 3 * one.expected_output
