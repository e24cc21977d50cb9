"""Which prefixes each replica holds, where the engines publish no KV events: what every gateway
sent there, shared.

Without KV events a gateway's prefix index (`ReplicaPrefixIndex.approx`) knows only what it sent
itself. With N gateways behind one load balancer spreading requests, each sees about 1/N of
every conversation, so prefix routing finds a warm replica about 1/N as often as one gateway
would (measured in the `prefix` scenario: the engines' hit rate 19% through one gateway, 13-14%
through three). So each gateway logs the blocks it was the first to send to a replica (`sent`:
the tail of the prompt its own index did not hold yet; the head was logged when it was new) and
puts the recent log in its part; each gateway records the others' entries in its own index, once
each (`PeerPrefixes`). An entry stays in the part for `KEEP_S`, several syncs, so a reader that
misses a sync still gets it; a reader that misses them all loses it, as an LRU index may lose a
block anyway. Where engines publish KV events each gateway subscribes itself and this is moot.
"""

from __future__ import annotations

from collections import deque

from bouncer.core.fleet.replica import ReplicaState

KEEP_S = 0.2  # an entry is in this gateway's part this long: about ten 20-ms syncs
APPLIED_KEEP_S = 5.0  # entries already recorded, remembered this long (longer than any entry is offered)

Entry = tuple[int, str, list[int]]  # sequence number at its gateway, replica, block digests


class SentPrefixes:
    """What this gateway sent, for its part (the core logs only while it shares state)."""

    def __init__(self) -> None:
        self._seq = 0
        self._log: deque[tuple[float, Entry]] = deque()

    def sent(self, replica: str, digests: list[int], now: float) -> None:
        if not digests:
            return
        self._seq += 1
        self._log.append((now, (self._seq, replica, digests)))

    def recent(self, now: float) -> list[Entry]:
        log = self._log
        while log and log[0][0] < now - KEEP_S:
            log.popleft()
        return [entry for _, entry in log]


class PeerPrefixes:
    """The others' entries, each recorded once in the replica's index."""

    def __init__(self) -> None:
        self._applied: dict[tuple[int, str, int], float] = {}  # insertion order is time order

    def take(self, entries: list[Entry], replicas: dict[str, ReplicaState], now: float) -> None:
        applied = self._applied
        for seq, name, digests in entries:
            # two gateways' entries share a key only when they hold the same last block: the same
            # prompt's, sent to the same replica, so skipping either loses nothing
            key = (seq, name, digests[-1])
            if key in applied:
                continue
            applied[key] = now
            replica = replicas.get(name)
            if replica is not None:
                replica.prefix.approx.record(digests)
        while applied:
            oldest = next(iter(applied))
            if applied[oldest] >= now - APPLIED_KEEP_S:
                break
            del applied[oldest]
