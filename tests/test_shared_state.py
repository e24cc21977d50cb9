"""Several gateways, one set of rate limits: tenants' buckets in a real Redis (a `redis-server`
each test starts on its own port, so that it owns its faults).

What a user of two gateways behind a load balancer must see: together they let a tenant through
its limit once, not once per gateway; with Redis gone they go on as configured (fail-open: each
its share of the limit; fail-closed: 503 with Retry-After), and they come back to the shared
limits by themselves when Redis returns.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
import redis.asyncio as aioredis

from bouncer.bench.loopback import RedisServer
from bouncer.config import RateLimit, key_digest
from bouncer.config import SharedState as SharedStateConfig
from bouncer.core.outcomes import Reason
from bouncer.core.sharing.shared_rate_limits import SharedRateLimits
from bouncer.gateway.shared_state import SharedState
from bouncer.tokenizer import default_tokenizer_path
from conftest import start_engine, start_gateway
from gateway_setup import tenant
from servers import BackgroundLoop, poll_until

LIMIT = RateLimit(requests_per_s=4, request_burst=4)


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


# -- the store the core reads (pure) -------------------------------------------------------------

def test_the_core_takes_the_verdict_the_shell_fetched_and_gives_back_what_it_did_not_take():
    store = SharedRateLimits()
    store.configure("t", LIMIT, 0.0)
    store.prepay("t", 10, None)
    assert store.take("t", 10, 0.0) is None  # the shared store's pass, not a local bucket's
    store.prepay("t", 10, (Reason.RATE_LIMITED_REQUESTS, 0.25))
    assert store.take("t", 10, 0.0) == (Reason.RATE_LIMITED_REQUESTS, 0.25)
    store.prepay("t", 7, None)  # an earlier layer refused it: the core never took it
    assert store.unconsumed() == [("t", 7)] and store.unconsumed() == []
    store.refund("t", 10, 0.0)  # a later layer refused one that passed
    assert store.drain_refunds() == [("t", 10)] and store.drain_refunds() == []


def test_degraded_each_gateway_decides_with_its_share_and_the_precheck_reads_reported_levels():
    store = SharedRateLimits()
    store.configure("t", LIMIT, 0.0)
    store.set_gateways(2, 0.0)
    store.degraded = True
    passed = sum(store.take("t", 1, 0.0) is None for _ in range(10))
    assert passed == 2  # burst 4 over 2 gateways
    store.degraded = False
    store.report("t", 0.0, None, 10.0)  # the shared bucket empty at t=10
    reason, wait = store.blocked("t", 10.0)
    assert reason == Reason.RATE_LIMITED_REQUESTS and wait == pytest.approx(0.25)
    assert store.blocked("t", 10.3) is None  # refilled at 4/s since


# -- the Redis scripts, two gateways' links to one Redis -----------------------------------------

def _links(url: str, n: int, **cfg) -> list[SharedState]:
    links = []
    for i in range(n):
        store = SharedRateLimits()
        store.configure("t", LIMIT, time.monotonic())
        links.append(SharedState(SharedStateConfig(url=url, key_prefix="test:", **cfg), store, time.monotonic,
                                 gateway_id=f"g{i}"))
    return links


def test_two_gateways_share_one_bucket_in_redis(redis_server):
    async def scenario():
        a, b = _links(redis_server.url, 2)
        await a.start()
        await b.start()
        verdicts = []
        for link in (a, b) * 4:
            await link.charge("t", 10)
            verdicts.append(link.store.take("t", 10, time.monotonic()))
        await asyncio.sleep(a.cfg.lease_s / 3 + 0.1)  # a's presence renewed: b is counted too
        gateways = a.store.gateways

        async def at_once(link: SharedState, n: int) -> int:  # asked in one turn: one pipelined round trip
            await asyncio.gather(*(link.charge("t", 10) for _ in range(n)))
            return sum(link.store.take("t", 10, time.monotonic()) is None for _ in range(n))

        await asyncio.sleep(1.0)  # the bucket full again
        together = await at_once(a, 8)
        async with aioredis.from_url(redis_server.url) as admin:
            await admin.script_flush()  # as after a restart: no scripts
        await asyncio.sleep(1.0)
        after_flush = await at_once(b, 8)
        await a.close()
        await b.close()
        return verdicts, gateways, together, after_flush

    verdicts, gateways, together, after_flush = asyncio.run(scenario())
    assert [v is None for v in verdicts] == [True] * 4 + [False] * 4  # the burst of 4, once for both
    assert {v[0] for v in verdicts[4:]} == {Reason.RATE_LIMITED_REQUESTS}
    assert all(0 < v[1] <= 0.25 + 0.05 for v in verdicts[4:])  # Retry-After: until one more fits
    assert gateways == 2
    assert together == 4 and after_flush == 4


def test_claims_on_a_replica_hold_once_expire_with_their_lease_and_follow_each_sync(redis_server):
    """`bouncer.core.sharing.claims` in Redis: of two gateways that both saw room for one request, the
    second's claim fails with what the first holds; a killed gateway's claims are gone within
    lease_s; a sync writes what a gateway holds in full, its claims folded in."""
    from bouncer.core.outcomes import Claim
    from bouncer.core.sharing.peers import GatewayShare, ReplicaLoad

    held_by_b = {"r0": ReplicaLoad(blocks=5)}

    async def scenario():
        a, b = _links(redis_server.url, 2, lease_s=1.0)
        b.own_part, b.seen = (lambda: GatewayShare(dict(held_by_b))), (lambda others: None)
        await a.start()
        await b.start()
        first = await b.claim("r0", Claim(blocks=40, others_seen=0, slack=52))
        second = await a.claim("r0", Claim(blocks=40, others_seen=0, slack=12))
        seen_right = await a.claim("r0", Claim(blocks=40, others_seen=40, slack=12))  # a view that counts b's
        b.stop_tasks()  # killed: nothing said to Redis, its presence and claims left to expire
        await asyncio.sleep(1.1)
        after_lease = await a.claim("r0", Claim(blocks=10, others_seen=0, slack=0))
        await b.sync()  # b back: its part and what it holds on each replica, in full (5 blocks)
        tight = await a.claim("r0", Claim(blocks=10, others_seen=0, slack=4))
        roomy = await a.claim("r0", Claim(blocks=10, others_seen=0, slack=5))
        counts = dict(a.claims)
        await a.close()
        await b.close()
        return first, second, seen_right, after_lease, tight, roomy, counts

    first, second, seen_right, after_lease, tight, roomy, counts = asyncio.run(scenario())
    assert first is None and second == 40 and seen_right is None
    assert after_lease is None  # b's 40 blocks expired with its lease
    assert tight == 5 and roomy is None
    assert counts == {"held": 3, "refused": 2}


# -- end to end: two gateways, one engine, the openai-shaped requests users send -----------------

def _post(base: str, key: str) -> tuple[int, dict]:
    body = json.dumps({"model": "demo-llm", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, {**dict(err.headers), "body": json.loads(err.read())}


class TwoGateways:
    def __init__(self, redis_url: str | None, on_unavailable: str = "fail-open") -> None:
        self.bg = BackgroundLoop()
        engine, _, self._engine_cleanup = start_engine(self.bg, speed=8.0, num_blocks=4096, max_num_seqs=64)
        config = {
            "tenants": [tenant("limited", rate_limit={"requests_per_s": 4, "request_burst": 4}), tenant("free")],
            "models": [{"name": "demo-llm", "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                        "max_model_len": 4096, "backends": [{"url": engine, "name": "e0"}]}],
            "admin_keys_sha256": [key_digest("admin")],
        }
        if redis_url:
            config["shared_state"] = {"url": redis_url, "key_prefix": "e2e:", "lease_s": 3,
                                      "on_unavailable": on_unavailable}
        self.gateways = [start_gateway(self.bg, config) for _ in range(2)]
        self.urls = [g[0] for g in self.gateways]

    def burst(self, n: int, key: str = "limited") -> list[tuple[int, dict]]:
        """n requests, alternating between the gateways as a load balancer would."""
        return [_post(self.urls[i % 2], key) for i in range(n)]

    def core(self, i: int):
        return self.gateways[i][1]

    def close(self) -> None:
        for _, _, cleanup in self.gateways:
            cleanup()
        self._engine_cleanup()
        self.bg.close()


def _ok(answers) -> int:
    return sum(code == 200 for code, _ in answers)


def test_two_gateways_let_a_tenant_through_its_limit_once_not_twice(redis_server):
    alone = TwoGateways(None)
    try:
        t0 = time.monotonic()
        unshared = _ok(alone.burst(16))
        unshared_s = time.monotonic() - t0
    finally:
        alone.close()
    shared = TwoGateways(redis_server.url)
    try:
        poll_until(lambda: all(shared.bg.call(lambda i=i: shared.core(i).shared.available) for i in range(2)),
                   what="both gateways see Redis")
        t0 = time.monotonic()
        answers = shared.burst(16)
        elapsed = time.monotonic() - t0
        refused = [h for code, h in answers if code != 200]
    finally:
        shared.close()
    # one bucket of burst 4 refilling at 4/s, for both gateways together
    assert _ok(answers) <= 4 + 4 * elapsed + 1, (_ok(answers), elapsed)
    assert unshared >= 8 and unshared > 4 + 4 * unshared_s + 1, (unshared, unshared_s)  # each its own: twice
    assert refused and all(int(h["Retry-After"]) >= 1 and h["body"]["error"]["code"] == "rate_limited_requests"
                           for h in refused)


@pytest.mark.slow
def test_redis_gone_fail_open_each_gateway_its_share_then_shared_again(redis_server):
    g = TwoGateways(redis_server.url)
    try:
        poll_until(lambda: all(g.bg.call(lambda i=i: g.core(i).shared.store.gateways == 2) for i in range(2)),
                   timeout=10, what="both gateways counted")
        redis_server.stop()
        answers = g.burst(8)  # the first call finds Redis gone: degraded from then on
        codes = {code for code, _ in answers}
        assert codes <= {200, 429}, answers  # no 500, no 503: fail-open
        assert _ok(answers) <= 4 + 2, answers  # each gateway its half of the burst (and what refilled)
        assert all(g.bg.call(lambda i=i: g.core(i).shared.available) is False for i in range(2))
        with urllib.request.urlopen(g.urls[0] + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert "bouncer_shared_state_up 0.0" in metrics and "bouncer_shared_state_gateways 2.0" in metrics
        assert _ok(g.burst(4, key="free")) == 4  # tenants without limits never notice
        redis_server.start()  # back, empty
        poll_until(lambda: all(g.bg.call(lambda i=i: g.core(i).shared.available) for i in range(2)), timeout=10,
                   what="both gateways back on Redis")
        time.sleep(1.0)  # the local shares refilled; the shared bucket is full
        t0 = time.monotonic()
        answers = g.burst(12)
        assert 4 <= _ok(answers) <= 4 + 4 * (time.monotonic() - t0) + 1, answers
    finally:
        g.close()


@pytest.mark.slow
def test_redis_frozen_fail_closed_refuses_with_503_and_recovers(redis_server):
    g = TwoGateways(redis_server.url, on_unavailable="fail-closed")
    try:
        poll_until(lambda: all(g.bg.call(lambda i=i: g.core(i).shared.available) for i in range(2)), timeout=10,
                   what="both gateways see Redis")
        redis_server.freeze()  # it takes connections and answers nothing: each call times out
        t0 = time.monotonic()
        answers = g.burst(6)
        assert time.monotonic() - t0 < 2.0  # a timeout or two (50 ms each), then refused at once
        assert {code for code, _ in answers} == {503}, answers
        for _, h in answers:
            assert h["body"]["error"]["code"] == "shared_state_unavailable" and int(h["Retry-After"]) >= 1
        assert _ok(g.burst(4, key="free")) == 4  # no rate limit: nothing to share, nothing refused
        redis_server.thaw()
        poll_until(lambda: all(g.bg.call(lambda i=i: g.core(i).shared.available) for i in range(2)), timeout=10,
                   what="both gateways back on Redis")
        assert _ok(g.burst(4)) >= 1
    finally:
        redis_server.thaw()
        g.close()


def test_a_shared_state_that_is_not_redis_is_a_config_error():
    from bouncer.config import ConfigError, parse_config

    base = {"tenants": [tenant("a")], "models": [{"name": "m", "engine": "vllm", "backends": [{"url": "http://x"}]}]}
    with pytest.raises(ConfigError, match=r"shared_state.url.*redis://"):
        parse_config({**base, "shared_state": {"url": "http://127.0.0.1:6379"}})
    with pytest.raises(ConfigError, match="on_unavailable"):
        parse_config({**base, "shared_state": {"url": "redis://127.0.0.1:6379/0", "on_unavailable": "maybe"}})
    assert parse_config(base).shared_state is None  # unset: this gateway alone


@pytest.mark.slow
def test_bench_gateways_shows_the_limit_once_when_shared_and_once_per_gateway_alone():
    from bouncer.bench.gateway_processes import report, run

    result = run(gateways=2, engines=1, seconds=4.0)
    alone, shared = ({name: t["admitted_over_allowed"] for name, t in r["tenants"].items()
                      if "admitted_over_allowed" in t} for r in result["runs"])
    assert alone["limited"] >= 1.5 and alone["tokens"] >= 1.5, result  # each gateway its own limit
    assert shared["limited"] <= 1.15 and shared["tokens"] <= 1.15, result
    assert "sharing Redis" in report(result)


def test_a_gateway_holds_a_request_while_a_killed_gateways_claim_fills_its_replica_then_serves_it(redis_server):
    """Another gateway claimed 60 of a replica's 100 KV blocks since this one's view (a field in
    Redis, as a gateway killed right after its claim leaves it; this gateway scrapes the engine
    once, so nothing else tells it the engine is in fact idle): a request that would nearly fill
    the replica is claimed, refused, held (not sent to overfill it, not failed), and served once
    that claim expires with its lease."""
    bg = BackgroundLoop()
    engine, _, engine_cleanup = start_engine(bg, speed=8.0, num_blocks=100, max_num_seqs=16)
    config = {
        "tenants": [tenant("free", slo={"ttft_s": 30.0})],
        "models": [{"name": "demo-llm", "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                    "max_model_len": 4096, "backends": [{"url": engine, "name": "e0"}]}],
        "admin_keys_sha256": [key_digest("admin")],
        "shared_state": {"url": redis_server.url, "key_prefix": "claims:", "lease_s": 3},
        "policy": {"telemetry": {"scrape_interval_s": 60, "staleness_s": 120}},
    }
    base, gw, cleanup = start_gateway(bg, config)
    try:
        poll_until(lambda: bg.call(lambda: gw.core.replicas["e0"].capacity_blocks) == 100, what="scraped")
        poll_until(lambda: gw.shared.syncs > 0, what="synced")

        async def ghost():
            async with aioredis.from_url(redis_server.url) as r:
                secs, micros = await r.time()
                await r.hset("claims:{claims}:e0", "killed-gateway", f"{secs + micros / 1e6 + 2.0:.6f} 60")
        asyncio.run(ghost())
        # about 900 prompt tokens and 256 expected out: 73 blocks, leaving 19 of the 92 usable
        body = json.dumps({"model": "demo-llm", "prompt": "hello " * 300, "max_tokens": 300}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer free"})
        started = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                status, answer = resp.status, resp.read()
        except urllib.error.HTTPError as err:
            status, answer = err.code, err.read()
        took = time.monotonic() - started
        claims = dict(gw.shared.claims)
        assert status == 200 and 1.5 <= took < 10, (status, took, answer, claims)
        assert claims["refused"] >= 1 and claims["held"] >= 1, claims
        poll_until(lambda: bg.call(lambda: gw.core.view.inflight + gw.core.view.queued) == 0, what="permit returned")
    finally:
        cleanup()
        engine_cleanup()
        bg.close()


def test_token_charges_are_settled_at_usage_in_the_shared_bucket(redis_server):
    """With the buckets in Redis, a served request's token charge (prompt + max_tokens) is
    settled there at what it used (`SETTLE_TOKENS`, pipelined after the core call): requests
    that ask for far more than they use leave the tenant's shared token bucket nearly full."""
    async def scenario():
        [a] = _links(redis_server.url, 1)
        a.store.configure("t", RateLimit(tokens_per_min=60_000, token_burst=1000), time.monotonic())
        await a.start()
        for _ in range(5):  # each charged 900, uses 30: settled, the next one fits again
            await a.charge("t", 900)
            assert a.store.take("t", 900, time.monotonic()) is None
            a.store.settle("t", 900, 30, time.monotonic())
            a.settle()
            await asyncio.sleep(0.05)
        await a.charge("t", 900)
        verdict = a.store.take("t", 900, time.monotonic())
        await a.close()
        return verdict

    assert asyncio.run(scenario()) is None  # without the settling, the second was refused already
