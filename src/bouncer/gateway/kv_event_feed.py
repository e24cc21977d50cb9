"""Subscribing to engines' KV-cache events (ZMQ SUB), one task per replica that publishes them.

Each batch is decoded (`bouncer.kv_events_wire`) and handed to the core, which keeps that
replica's prefix index precise. Gaps in the sequence numbers (the publisher's high-water mark
dropped messages, or we reconnected) are counted, not repaired: the index may then hold stale
blocks until the engine evicts them again, which costs a missed hit, never a wrong answer. When
events stop altogether the core falls back to its approximate index by itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from bouncer.core.fleet.kv_events import KVEvent
from bouncer.kv_events_wire import WireError, decode_batch, decode_seq

log = logging.getLogger("bouncer.kv_events")


@dataclass
class SubscriberStats:
    batches: int = 0
    gaps: int = 0  # batches missed, by sequence number
    malformed: int = 0


async def subscribe(endpoint: str, topic: str, deliver: Callable[[list[KVEvent]], None],
                    stats: SubscriberStats, ctx: zmq.asyncio.Context) -> None:
    """Run until cancelled: receive batches from `endpoint` and `deliver` their events."""
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 100_000)
    sock.setsockopt_string(zmq.SUBSCRIBE, topic)
    sock.connect(endpoint)  # ZMQ reconnects by itself if the engine restarts
    last_seq: int | None = None
    try:
        while True:
            frames = await sock.recv_multipart()
            try:
                if len(frames) != 3:
                    raise WireError(f"expected (topic, seq, payload), got {len(frames)} frames")
                seq = decode_seq(frames[1])
                _ts, events = decode_batch(frames[2])
            except WireError as exc:
                stats.malformed += 1
                log.warning("KV event from %s dropped: %s", endpoint, exc)
                continue
            if last_seq is not None and seq > last_seq + 1:
                stats.gaps += seq - last_seq - 1
            last_seq = seq
            stats.batches += 1
            deliver(events)
    except asyncio.CancelledError:
        raise
    finally:
        sock.close(linger=0)
