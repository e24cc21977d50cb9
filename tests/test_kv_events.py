"""KV-cache events: vLLM's wire format, and the gateway following a real `bouncer engine`'s
publisher over ZMQ on loopback (then falling back when it goes quiet)."""

from __future__ import annotations

import asyncio

import msgspec
import openai
import pytest

from bouncer.config import key_digest
from bouncer.core.fleet.blocks import chain_block_hashes
from bouncer.core.fleet.cache_salt import salt_of, salt_root, salted
from bouncer.core.fleet.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from bouncer.kv_events_wire import WireError, decode_batch, decode_seq, encode_batch, encode_seq
from bouncer.tokenizer import PromptTokenizer, default_tokenizer_path
from conftest import start_engine, start_gateway
from servers import free_port, poll_until


def test_batches_round_trip_through_the_wire_format():
    events = [BlockStored([b"\x01" * 8, b"\x02" * 8], None, list(range(32)), 16), BlockRemoved([b"\x03" * 8]),
              AllBlocksCleared()]
    ts, decoded = decode_batch(encode_batch(12.5, events))
    assert ts == 12.5 and decoded == events
    assert decode_seq(encode_seq(41)) == 41


def test_decodes_the_older_array_form_and_every_tier():
    payload = msgspec.msgpack.encode([3.0, [
        ["BlockStored", [7], None, list(range(16)), 16, None, None],
        ["BlockStored", [7], None, [], 16, None, "CPU"],  # the same block offloaded, without tokens
        ["BlockStored", [9], None, list(range(16)), 16, 3, None],  # a LoRA adapter's: skipped
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "SomethingNew", "x": 1},  # a newer engine's event kind: skipped, not fatal
    ], 0])
    _, events = decode_batch(payload)
    assert events == [BlockStored([7], None, list(range(16)), 16), BlockStored([7], None, [], 16, "CPU"),
                      BlockRemoved([7])]


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"ts": 1}),
                                     msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]])])
def test_malformed_batches_are_refused_with_a_clear_error(payload):
    with pytest.raises(WireError):
        decode_batch(payload)


def test_gateway_follows_the_engines_kv_events_and_falls_back_when_they_stop(bg_loop):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"  # the engine binds every interface, as vLLM does with *
    engine_url, engine, stop_engine = start_engine(bg_loop, speed=50.0, kv_events=f"tcp://*:{port}", num_blocks=512)
    config = {
        "tenants": [{"name": "t", "api_keys_sha256": [key_digest("t")], "priority": 0}],
        "models": [{"name": "demo-llm", "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                    "backends": [{"url": engine_url, "name": "e0", "kv_events": endpoint}]}],
        "policy": {"telemetry": {"scrape_interval_s": 0.05}, "routing": {"kv_events_staleness_s": 0.5}},
    }
    url, gw, stop_gateway = start_gateway(bg_loop, config)
    try:
        tokenizer = PromptTokenizer(str(default_tokenizer_path()))
        prompt = "Bouncer decides whether and when; the router decides where. " * 20

        async def ask(text: str) -> None:
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="t", max_retries=0, timeout=30)
            await client.completions.create(model="demo-llm", prompt=text, max_tokens=4)

        index = lambda: gw.core.replicas["e0"].prefix  # noqa: E731
        # tenant t's prompts are cached under its salt, at the engine and in the gateway's index
        root = salt_root(salt_of("t"))
        # ZMQ subscriptions take a moment to join: ask (a new prompt each time, so the engine has
        # new blocks to report) until the events of one have come through
        for attempt in range(40):
            text = f"Attempt {attempt}. {prompt}"
            digests = salted(chain_block_hashes(tokenizer.encode(text), 16), root)
            asyncio.run(ask(text))
            if bg_loop.call(lambda d=digests: index().precise is not None and index().precise.match(d) > 0):
                break
        else:
            raise AssertionError("no KV event reached the gateway")
        assert len(digests) >= 10
        # the engine's own (differently hashed) blocks map back onto our digests, block for block
        assert bg_loop.call(lambda: index().precise.match(digests)) == len(digests)
        state = bg_loop.call(lambda: gw.core.snapshot(gw.clock()))["models"]["demo-llm"]["replicas"]["e0"]
        assert state["prefix_index"]["mode"] == "precise" and state["prefix_index"]["unplaced_blocks"] == 0
        stats = bg_loop.call(lambda: gw.kv_event_stats["e0"])
        assert stats.batches > 0 and stats.malformed == 0
        metrics = asyncio.run(_get(url + "/metrics"))
        assert 'bouncer_replica_prefix_index_precise{replica="e0"} 1.0' in metrics

        # the publisher goes quiet while work is still sent: after the staleness window the
        # approximate index (fed all along) answers instead
        publisher = engine.kv_events
        bg_loop.call(lambda: setattr(engine, "kv_events", None))
        silent = "A new prompt the engine will never report. " * 10
        asyncio.run(ask(silent))
        poll_until(lambda: bg_loop.call(lambda: not index().events_live(gw.clock())), timeout=5,
                   what="fallback to the approximate index")
        other = salted(chain_block_hashes(tokenizer.encode(silent), 16), root)
        assert bg_loop.call(lambda: index().precise.match(other)) == 0  # never reported
        assert bg_loop.call(lambda: index().match(other, gw.clock())) == len(other)  # but we sent it there
        bg_loop.call(publisher.close)
    finally:
        stop_gateway()
        stop_engine()


async def _get(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as resp:
        return await resp.text()
