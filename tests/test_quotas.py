"""Quotas: the calendar arithmetic by explicit time, the reservation rules held by the in-process
ledger and by the Redis one alike (a real `redis-server` the test starts), and what the core
does with a spent quota (refuse, demote, divert)."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from bouncer.bench.loopback import RedisServer
from bouncer.config import ConfigError, key_digest, parse_config
from bouncer.core.admission import AdmissionCore
from bouncer.core.outcomes import Dispatch, Divert, Reason, Reject, Terminal
from bouncer.core.requests import OverQuota, RequestInfo
from bouncer.gateway.quota_store import RedisQuotaLedger
from bouncer.quotas.ledger import Hold, Level, LocalQuotaLedger
from bouncer.quotas.plan import QuotaPlan
from bouncer.quotas.windows import window_at


def _at(*args, tz: str = "UTC") -> float:
    import zoneinfo

    return dt.datetime(*args, tzinfo=zoneinfo.ZoneInfo(tz)).timestamp()


# -- calendar windows ------------------------------------------------------------------------------

def test_a_month_ends_on_the_first_of_the_next_across_the_year_and_in_a_leap_february():
    w = window_at("month", "UTC", _at(2026, 12, 31, 23, 59, 59))
    assert (w.label, w.start, w.end) == ("2026-12", _at(2026, 12, 1), _at(2027, 1, 1))
    leap = window_at("month", "UTC", _at(2028, 2, 29, 12))
    assert (leap.label, leap.end - leap.start) == ("2028-02", 29 * 86400)
    assert window_at("month", "UTC", _at(2027, 2, 28, 12)).end == _at(2027, 3, 1)


def test_a_day_is_the_local_calendars_and_lasts_23_or_25_hours_across_a_clock_change():
    # 23:30 in New York is already the next day in UTC: the local day holds it
    at = _at(2026, 12, 4, 23, 30, tz="America/New_York")
    assert window_at("day", "America/New_York", at).label == "2026-12-04"
    assert window_at("day", "UTC", at).label == "2026-12-05"
    spring = window_at("day", "Europe/Paris", _at(2026, 3, 29, 12, tz="Europe/Paris"))
    autumn = window_at("day", "Europe/Paris", _at(2026, 10, 25, 12, tz="Europe/Paris"))
    assert (spring.end - spring.start, autumn.end - autumn.start) == (23 * 3600, 25 * 3600)
    assert spring.start == _at(2026, 3, 29, tz="Europe/Paris")


def test_a_week_starts_on_monday_and_the_hour_an_autumn_clock_repeats_is_another_window():
    w = window_at("week", "UTC", _at(2027, 1, 3, 18))  # a Sunday, in ISO week 53 of 2026
    assert (w.label, w.start, w.end) == ("2026-W53", _at(2026, 12, 28), _at(2027, 1, 4))
    first = window_at("hour", "Europe/Paris", _at(2026, 10, 25, 0, 30, tz="UTC"))  # 02:30 CEST
    second = window_at("hour", "Europe/Paris", _at(2026, 10, 25, 1, 30, tz="UTC"))  # 02:30 CET
    assert first.label != second.label and first.end == second.start and second.end - second.start == 3600


# -- the config and the plan -----------------------------------------------------------------------

def _config(**over) -> dict:
    cfg = {
        "tenants": [
            {"name": "acme-chat", "api_keys_sha256": [key_digest("acme-chat")], "priority": 1,
             "quota": {"limits": [{"window": "day", "unit": "total_tokens", "limit": 1000}], "over": "refuse"}},
            {"name": "acme-batch", "api_keys_sha256": [key_digest("acme-batch")], "overflow": True,
             "quota": {"limits": [{"window": "month", "unit": "usd", "limit": 2.0, "time_zone": "Europe/Paris"}],
                       "over": "demote", "demote_band": -2}},
            {"name": "other", "api_keys_sha256": [key_digest("other")]},
        ],
        "models": [{"name": "m", "backends": [{"url": "http://127.0.0.1:1"}],
                    "price": {"input_per_million": 1.0, "output_per_million": 4.0},
                    "overflow": [{"name": "cloud", "url": "https://api.example.com", "requests_per_s": 1,
                                  "burst": 1, "price": {"input_per_million": 3, "output_per_million": 15}}]}],
        "quotas": {"url": "redis://127.0.0.1:1/0", "groups": [
            {"name": "acme", "level": "org", "tenants": ["acme-chat", "acme-batch"],
             "limits": [{"window": "week", "unit": "completion_tokens", "limit": 500}]}]},
    }
    cfg.update(over)
    return cfg


def test_the_plan_charges_a_tenants_own_limits_and_its_groups_each_in_its_unit_and_price():
    plan = QuotaPlan(parse_config(_config()))
    assert not plan.applies("other")
    at = _at(2026, 12, 5, 10)
    chat = plan.charges(plan.lines["acme-chat"], 100, 40, plan.price("m"), at)
    assert [(c.line.scope, c.line.owner, c.amount) for c in chat] == [("tenant", "acme-chat", 140.0),
                                                                       ("org", "acme", 40.0)]
    batch = plan.charges(plan.lines["acme-batch"], 1_000_000, 1_000_000, plan.price("m", "cloud"), at)
    assert batch[0].amount == pytest.approx(18.0)  # at the overflow's price: 3 + 15
    assert batch[0].key == "bouncer:quota:tenant:acme-batch:usd:month:Europe/Paris:2026-12"
    spent = plan.verdict("acme-batch", [batch[0]], at)
    assert (spent.action, spent.band, spent.resets_in_s) == ("demote", -2, _at(2027, 1, 1, tz="Europe/Paris") - at)


@pytest.mark.parametrize("change, message", [
    ({"quotas": None}, "need `quotas`"),
    ({"quotas": {"url": "redis://x:1/0", "groups": [{"name": "g", "tenants": ["nobody"],
                                                     "limits": [{"window": "day", "limit": 1}]}]}}, "unknown tenant"),
    ({"quotas": {"url": "redis://x:1/0", "groups": [
        {"name": "g1", "tenants": ["other"], "limits": [{"window": "day", "limit": 1}]},
        {"name": "g2", "tenants": ["other"], "limits": [{"window": "day", "limit": 1}]}]}}, "two org groups"),
    ({"quotas": {"url": "redis://x:1/0", "time_zone": "Mars/Olympus"}}, "unknown time zone"),
])
def test_bad_quota_configs_say_what_is_wrong(change, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(_config(**change))


def test_usd_quotas_need_prices_and_an_overflow_model_must_exist():
    cfg = _config()
    cfg["models"][0] = {**cfg["models"][0], "price": None}
    with pytest.raises(ConfigError, match="need a `price` on every model"):
        parse_config(cfg)
    cfg = _config()
    cfg["models"][0] = {**cfg["models"][0], "overflow": [{"name": "x", "model": "nope"}]}
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        parse_config(cfg)


# -- the reservation rules, on both ledgers ---------------------------------------------------------

class _Local:
    """The in-process ledger, its clock moved by hand."""

    def __init__(self) -> None:
        self.ledger, self.now = LocalQuotaLedger(), 0.0

    async def reserve(self, rid, holds, force, lease_s):
        return self.ledger.reserve(rid, holds, force, lease_s, self.now)

    async def settle(self, rid, used):
        self.ledger.settle(rid, [(k, a) for k, a, _ in used])

    async def levels(self, keys):
        return self.ledger.levels(keys)

    async def wait(self, seconds):
        self.now += seconds


class _Redis:
    def __init__(self, url: str) -> None:
        self.ledger = RedisQuotaLedger(url, "t:", 1.0)

    async def reserve(self, rid, holds, force, lease_s):
        return await self.ledger.reserve(rid, holds, force, lease_s)

    async def settle(self, rid, used):
        await self.ledger.settle(rid, used)

    async def levels(self, keys):
        return await self.ledger.levels(keys)

    async def wait(self, seconds):
        await asyncio.sleep(seconds)


@pytest.fixture(params=["local", "redis"])
def ledger(request):
    if request.param == "local":
        yield _Local()
        return
    server = RedisServer()
    try:
        yield _Redis(server.url)
    finally:
        server.stop()


def test_reservations_hold_on_every_line_or_none_settle_what_was_used_and_expire_unrenewed(ledger):
    far = _at(2030, 1, 1)

    async def rules():
        day, org = Hold("day", 100, 60, far), Hold("org", 1000, 60, far)
        assert await ledger.reserve("a", [day, org], False, 0.3) == []
        assert await ledger.reserve("b", [day, org], False, 0.3) == [0]  # 120 > 100 on the day: nothing reserved
        assert [tuple(x) for x in await ledger.levels(["day", "org"])] == [(0, 60), (0, 60)]
        await ledger.settle("a", [("day", 45, far), ("org", 45, far)])  # it used less than it reserved
        assert [tuple(x) for x in await ledger.levels(["day", "org"])] == [(45, 0), (45, 0)]
        await ledger.settle("a", [("day", 45, far), ("org", 45, far)])  # the same settle again counts once
        assert (await ledger.levels(["day"]))[0].spent == 45
        assert await ledger.reserve("c", [Hold("day2", 100, 80, far)], False, 0.3) == []
        assert await ledger.reserve("d", [Hold("day2", 100, 80, far)], True, 0.3) == [0]  # forced: over, held
        assert tuple((await ledger.levels(["day2"]))[0]) == (0, 160)
        await ledger.wait(0.5)  # both leases run out unrenewed: the next reserve gives them back
        assert await ledger.reserve("e", [Hold("day2", 100, 10, far)], False, 0.3) == []
        assert tuple((await ledger.levels(["day2"]))[0]) == (0, 10)
        await ledger.settle("c", [("day2", 70, far)])  # settled after its lease: only the spend is added
        assert tuple((await ledger.levels(["day2"]))[0]) == (70, 10)

    asyncio.run(rules())


def test_a_shadow_line_without_room_is_counted_never_in_the_way(ledger):
    """A shadow limit (`QuotaLimit.shadow`) is reserved on and settled like any, and named among
    the lines without room, but does not keep the request from reserving on the others."""
    far = _at(2030, 1, 1)

    async def rules():
        shadow, real = Hold("trial", 50, 60, far, blocks=False), Hold("month", 1000, 60, far)
        assert await ledger.reserve("a", [shadow, real], False, 30) == [0]  # over the shadow line: reserved anyway
        assert [tuple(x) for x in await ledger.levels(["trial", "month"])] == [(0, 60), (0, 60)]
        assert await ledger.reserve("b", [shadow, Hold("month", 100, 60, far)], False, 30) == [0, 1]  # a real one
        assert [tuple(x) for x in await ledger.levels(["trial", "month"])] == [(0, 60), (0, 60)]  # nothing more

    asyncio.run(rules())


def test_shadow_limits_are_reported_and_counted_past_without_a_verdict():
    from bouncer.quotas.book import QuotaBook

    cfg = _config()
    cfg["tenants"][0]["quota"]["limits"].append({"window": "day", "limit": 10, "shadow": True})
    book = QuotaBook(parse_config(cfg))
    at = _at(2026, 12, 5, 10)
    asked = book.ask("acme-chat", "m", 100, 40, at)
    shadow = next(i for i, c in enumerate(asked.charges) if c.line.limit.shadow)
    assert book.answered("r", asked, [shadow], at) is None and "r" in book.held  # served, and its spend counts
    [row] = [book.row(c, Level(0, 0)) for c in asked.charges if c.line.limit.shadow]
    assert row["shadow"] is True and row["shadow_over"] == 1


# -- what the core does with a spent quota ---------------------------------------------------------

def _core(cfg: dict) -> AdmissionCore:
    from bouncer.core.fleet.replica import Telemetry

    config = parse_config(cfg)
    core = AdmissionCore(config, 0.0)
    for name in core.view.replica_names():
        core.observe(name, Telemetry(at=0.0, kv_usage=0.1, running=0, waiting=0), 0.0)
    return core


def _info(rid: str, key: str, over: OverQuota | None = None) -> RequestInfo:
    return RequestInfo(rid, key_digest(key), "m", prompt_tokens=100, max_tokens=50, over_quota=over)


def test_a_spent_quota_is_refused_with_its_reset_or_demoted_or_diverted_as_its_tenant_says():
    core = _core(_config())
    week = OverQuota("refuse", -1, 3 * 86400, "org acme: 500 completion_tokens per week")
    [refused] = core.offer(_info("r1", "acme-chat", week), 1.0)
    assert isinstance(refused, Reject) and refused.refusal.reason is Reason.QUOTA_EXHAUSTED
    assert refused.refusal.status == 429 and refused.refusal.retry_after == 3 * 86400
    assert refused.refusal.should_retry is False  # three days is past any TTL: waiting cannot help it
    soon = core.offer(_info("r2", "acme-chat", week._replace(resets_in_s=5)), 1.0)[0].refusal
    assert soon.should_retry is True and "resets in 5 s" in soon.message

    [demoted] = core.offer(_info("r3", "acme-batch", OverQuota("demote", -2, 100, "x")), 1.0)
    assert isinstance(demoted, Dispatch) and demoted.band == -2

    [diverted] = core.offer(_info("r4", "acme-batch", OverQuota("divert", -2, 100, "x")), 1.0)
    assert isinstance(diverted, Divert) and diverted.target == "cloud"
    [no_room] = core.offer(_info("r5", "acme-batch", OverQuota("divert", -2, 100, "x")), 1.0)  # its bucket of 1 spent
    assert isinstance(no_room, Reject) and no_room.refusal.reason is Reason.QUOTA_EXHAUSTED
    stats = core.view.stats
    assert stats.outcomes[Terminal.DIVERTED] == 1
    assert stats.decisions[("demoted", "rate", "quota_exhausted", "acme-batch", -2)] == 1


def test_a_saturated_pool_diverts_the_tenants_allowed_to_overflow_and_refuses_the_rest():
    cfg = _config()
    cfg["models"][0]["overflow"] = [{"name": "cloud", "url": "https://api.example.com"}]
    cfg["policy"] = {"queues": {"max_requests": 1}}
    core = _core(cfg)
    for r in core.view.replica_names():  # every replica full: nothing dispatches, the queue holds one
        from bouncer.core.fleet.replica import Telemetry
        core.observe(r, Telemetry(at=1.0, kv_usage=0.999, running=256, waiting=50), 1.0)
    events = [e for i in range(6) for e in core.offer(_info(f"q{i}", ["other", "acme-batch"][i % 2]), 1.0)]
    ends = {e.request_id: e for e in events if isinstance(e, (Reject, Divert))}
    assert {type(ends[f"q{i}"]) for i in (1, 3, 5) if f"q{i}" in ends} == {Divert}
    assert all(isinstance(ends[f"q{i}"], Reject) for i in (2, 4) if f"q{i}" in ends)
    assert any(isinstance(e, Divert) for e in events) and any(isinstance(e, Reject) for e in events)


def test_a_demoted_tenants_requests_are_judged_in_its_demoted_band_from_the_precheck_on():
    core = _core(_config())
    batch = next(t for t in core.config.tenants if t.name == "acme-batch")
    assert core.precheck(_info("p0", "acme-batch"), 1.0).priority == batch.priority
    core.offer(_info("p1", "acme-batch", OverQuota("demote", -2, 100, "x")), 1.0)
    # the next request's precheck (before the shell has looked at its quota) already sees band -2
    assert core.precheck(_info("p2", "acme-batch"), 2.0).priority == -2
    assert core.precheck(_info("p3", "acme-batch"), 102.0).priority == batch.priority  # the window reset
    core.offer(_info("p4", "acme-batch", OverQuota("demote", -2, 100, "x")), 200.0)
    core.offer(_info("p5", "acme-batch"), 201.0)  # found within its quota again (an operator's reset)
    assert core.precheck(_info("p6", "acme-batch"), 202.0).priority == batch.priority


def test_an_answer_the_gateway_did_not_see_is_charged_its_reservation_one_it_saw_what_it_used():
    from bouncer.quotas.book import QuotaBook

    book = QuotaBook(parse_config(_config()))
    at = _at(2026, 12, 5, 10)
    for rid in ("seen", "unseen"):
        asked = book.ask("acme-chat", "m", 100, 40, at)
        assert book.answered(rid, asked, [], at) is None
    assert [a for _, a, _ in book.used("seen", 100, 25)] == [125.0, 25.0]  # total tokens; the org's completion
    assert [a for _, a, _ in book.used("unseen", 100, None)] == [140.0, 40.0]  # as reserved: prompt + predicted
    assert book.used("seen", 100, 25) is None and not book.held  # settled once, nothing left held
