"""Several gateways count each other's requests on every replica, through a real Redis (a
`redis-server` each test starts on its own port).

What a user of two gateways must see: a request one gateway sent is counted by the other on its
replica within a sync or two; a gateway that dies stops being counted within its lease; with
Redis gone, the last view lasts one lease, then each gateway counts only its own.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

import pytest

from bouncer.bench.loopback import RedisServer
from bouncer.config import SharedState as SharedStateConfig
from bouncer.config import key_digest
from bouncer.core.sharing.first_attempts import SharedRetries
from bouncer.core.sharing.peers import GatewayShare, ReplicaLoad
from bouncer.core.sharing.shared_rate_limits import SharedRateLimits
from bouncer.gateway.shared_state import SharedState
from bouncer.tokenizer import default_tokenizer_path
from conftest import start_engine, start_gateway
from gateway_setup import tenant
from servers import BackgroundLoop, poll_until

LEASE_S = 1.0


@pytest.fixture
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


def _link(url: str, name: str, part: GatewayShare, seen: list) -> SharedState:
    cfg = SharedStateConfig(url=url, key_prefix="load:", lease_s=LEASE_S, sync_ms=20)
    return SharedState(cfg, SharedRateLimits(), time.monotonic, gateway_id=name, own_part=lambda: part,
                       seen=lambda others: seen.append((time.monotonic(), others)))


def test_each_gateway_reads_the_others_parts_and_a_silent_gateways_part_ends_with_its_lease(redis_server):
    a_part = GatewayShare({"e0": ReplicaLoad(requests=3, blocks=40)}, {("m", 0, "t"): 500.0}, {("m", 0, "t"): (1.5, 2)})
    b_part = GatewayShare({"e0": ReplicaLoad(requests=1, blocks=8)})

    async def scenario():
        seen_a: list = []
        seen_b: list = []
        a = _link(redis_server.url, "a", a_part, seen_a)
        b = _link(redis_server.url, "b", b_part, seen_b)
        await a.start()
        await b.start()
        await asyncio.sleep(0.3)
        views = (seen_a[-1][1], seen_b[-1][1])
        # a dies without a word: its tasks stop, nothing is removed from Redis
        a.stop_tasks()
        died = time.monotonic()
        await asyncio.sleep(LEASE_S + 0.5)
        gone_at = next(at for at, others in seen_b if at > died and not others)
        syncs = b.syncs
        await b.close()
        await a._redis.aclose()
        return views, gone_at - died, syncs

    (a_sees, b_sees), gone_after, syncs = asyncio.run(scenario())
    assert a_sees == [b_part] and b_sees == [a_part]  # each the other's part, exactly, not its own
    assert LEASE_S - 0.1 <= gone_after <= LEASE_S + 0.2, gone_after
    assert syncs >= 30  # every 20 ms (a loaded machine may stretch them)


def test_redis_gone_the_last_view_lasts_one_lease_then_each_gateway_counts_its_own(redis_server):
    part = GatewayShare({"e0": ReplicaLoad(requests=2)})

    async def scenario():
        seen_a: list = []
        a = _link(redis_server.url, "a", GatewayShare(), seen_a)
        b = _link(redis_server.url, "b", part, [])
        await a.start()
        await b.start()
        await asyncio.sleep(0.2)
        before = seen_a[-1][1]
        redis_server.stop()
        stopped = time.monotonic()
        await asyncio.sleep(LEASE_S + 1.2)  # failing syncs are retried every PROBE_S while degraded
        dropped = [at - stopped for at, others in seen_a if at > stopped and not others]
        redis_server.start()
        await asyncio.sleep(2.0)  # the presence probe (every PROBE_S) finds it, then a sync reads at once
        after = seen_a[-1][1]
        await a.close()
        await b.close()
        return before, dropped, after, a.available

    before, dropped, after, available = asyncio.run(scenario())
    assert before == [part]
    assert len(dropped) == 1 and LEASE_S <= dropped[0] <= LEASE_S + 1.0, dropped
    assert after == [part] and available, (after, available)  # back by itself, the other's part read again


def test_a_request_one_gateway_sent_is_counted_by_the_other_on_its_replica_and_its_blocks_indexed(redis_server):
    bg = BackgroundLoop()
    engine, _, engine_cleanup = start_engine(bg, speed=1.0, num_blocks=4096, max_num_seqs=64)
    config = {
        "tenants": [tenant("t")],
        "models": [{"name": "demo-llm", "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                    "max_model_len": 4096, "backends": [{"url": engine, "name": "e0"}]}],
        "admin_keys_sha256": [key_digest("admin")],
        "shared_state": {"url": redis_server.url, "key_prefix": "e2e-load:", "lease_s": LEASE_S},
    }
    gateways = [start_gateway(bg, config) for _ in range(2)]
    (url_a, core_a, _), (_, core_b, _) = gateways

    def counted_by(gw) -> tuple[int, int]:
        """(its own requests on the engine, every gateway's as it counts them)"""
        (r,) = gw.core.replicas.values()
        return len(r.inflight), r.requests_in_flight

    def long_request() -> None:
        prompt = " ".join(f"word{i}" for i in range(300))  # some 20 blocks of 16 tokens
        body = json.dumps({"model": "demo-llm", "prompt": prompt, "max_tokens": 400}).encode()
        req = urllib.request.Request(url_a + "/v1/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer t"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            resp.read()

    try:
        poll_until(lambda: all(bg.call(lambda g=g: g.shared.peers_seen == 1) for _, g, _ in gateways), timeout=10,
                   what="each gateway reads the other's part")
        sender = threading.Thread(target=long_request)
        sender.start()
        poll_until(lambda: bg.call(lambda: counted_by(core_a)) == (1, 1), timeout=10, what="a sends it")
        poll_until(lambda: bg.call(lambda: counted_by(core_b)) == (0, 1), timeout=2, what="b counts a's request")
        sender.join(60)
        poll_until(lambda: bg.call(lambda: counted_by(core_b)) == (0, 0), timeout=2, what="b sees it end")
        # the engine publishes no KV events: b's prefix index learns the blocks a sent from a's part
        def indexed(gw) -> int:
            (r,) = gw.core.replicas.values()
            return len(r.prefix.approx)

        assert bg.call(lambda: indexed(core_a)) >= 10
        poll_until(lambda: bg.call(lambda: indexed(core_b)) == bg.call(lambda: indexed(core_a)), timeout=2,
                   what="b indexes the blocks a sent")
        with urllib.request.urlopen(url_a.replace("/v1", "") + "/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert "bouncer_shared_state_peers 1.0" in metrics
    finally:
        for _, _, cleanup in gateways:
            cleanup()
        engine_cleanup()
        bg.close()


def test_a_retry_at_another_gateway_keeps_the_first_attempts_arrival(redis_server):
    """The first attempt reaches gateway a; its retry, 3 s later, reaches b: b offers it with the
    first attempt's arrival (so its deadline is its user's), which b alone could not know."""
    key = ("t", "demo-llm", 12345, 64)

    async def scenario():
        links = []
        for name in ("a", "b"):
            cfg = SharedStateConfig(url=redis_server.url, key_prefix="retries:", lease_s=LEASE_S)
            retries = SharedRetries(remember_s=120, max_entries=100)
            links.append(SharedState(cfg, SharedRateLimits(), time.monotonic, gateway_id=name, retries=retries))
        a, b = links
        await a.start()
        await b.start()
        first = time.monotonic()
        assert a.retries.arrived(key, retry=False, now=first) == first
        a.settle()  # written back in the background
        await asyncio.sleep(0.2)
        await b.first_attempt(key)
        seen_by_b = b.retries.arrived(key, retry=True, now=first + 3.0)
        stored = await b._redis.get(b._retry_key(key))
        b.retries.completed(key)  # answered at b: forgotten in Redis too
        b.settle()
        await asyncio.sleep(0.2)
        after = await b._redis.get(b._retry_key(key))
        alone = SharedRetries(remember_s=120, max_entries=100).arrived(key, retry=True, now=first + 3.0)
        await a.close()
        await b.close()
        return first, seen_by_b, stored, after, alone

    first, seen_by_b, stored, after, alone = asyncio.run(scenario())
    assert seen_by_b == pytest.approx(first, abs=0.01)
    assert alone == pytest.approx(first + 3.0)  # what b would have said alone: a fresh deadline
    assert stored is not None and after is None
