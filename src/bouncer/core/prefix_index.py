"""What the router believes each replica holds in its prefix cache.

Two sources, one view per replica (`ReplicaPrefixIndex`):
- approximate: what the gateway itself sent there (no engine cooperation needed), bounded by the
  replica's KV capacity in blocks and aged out least-recently-used, like the engine's own cache;
- precise: the engine's KV events (`bouncer.core.kv_events`), used while they flow.

A replica's useful cache for a prompt is the *longest contiguous* run of the prompt's chained
block digests from the start: a replica holding only later blocks scores zero.
"""

from __future__ import annotations

from collections import OrderedDict

from bouncer.core.blocks import leading_run
from bouncer.core.kv_events import KVEvent, PreciseIndex


class ApproxPrefixIndex:
    __slots__ = ("capacity", "_blocks", "version")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.version = 0  # moves with every change of what it holds (`ReplicaPrefixIndex.match` remembers by it)

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, digests: list[int]) -> int:
        """Leading blocks of `digests` believed cached here."""
        return leading_run(digests, self._blocks)

    def record(self, digests: list[int]) -> int:
        """The prompt was sent here: its blocks become the most recently used. Returns how many
        of its leading blocks were held already (the rest are new here)."""
        blocks = self._blocks
        self.version += 1
        held = None
        for i, d in enumerate(digests):
            if d in blocks:
                blocks.move_to_end(d)
            else:
                blocks[d] = None
                if held is None:
                    held = i
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
        return len(digests) if held is None else held

    def forget(self, digests: list[int]) -> None:
        """What `record` added was not sent after all (a claim that failed, `core.claims`)."""
        self.version += 1
        for d in digests:
            self._blocks.pop(d, None)


class ReplicaPrefixIndex:
    """The engine's KV events while they flow, else what we sent there.

    Events count as flowing unless work was sent to the replica and no event followed for
    `events_staleness_s` (an idle engine has nothing to report, so silence alone proves nothing).
    Once they stop, the approximate index, fed all along, takes over without a cold start."""

    __slots__ = ("approx", "precise", "block_size", "events_staleness_s", "unanswered_since", "_last_match")

    def __init__(self, capacity_blocks: int, block_size: int, events_staleness_s: float) -> None:
        self.approx = ApproxPrefixIndex(capacity_blocks)
        self.precise: PreciseIndex | None = None  # created by the first event
        self.block_size = block_size
        self.events_staleness_s = events_staleness_s
        self.unanswered_since: float | None = None  # first send after the latest event
        # the last answer of `match`: (digests, the index asked, its version, held). One request's
        # prompt is matched here more than once in a core call (its best TTFT, then its
        # placement), and a 130k-token prompt is 8,500 lookups each time
        self._last_match: tuple[list[int], ApproxPrefixIndex | PreciseIndex, int, int] | None = None

    def resize(self, capacity_blocks: int) -> None:
        self.approx.capacity = capacity_blocks
        if self.precise is not None:
            self.precise.capacity = capacity_blocks

    def events_live(self, now: float) -> bool:
        p = self.precise
        if p is None or p.last_event_at is None:
            return False
        return self.unanswered_since is None or now - self.unanswered_since <= self.events_staleness_s

    def match(self, digests: list[int], now: float) -> int:
        index: ApproxPrefixIndex | PreciseIndex = self.precise if self.events_live(now) else self.approx  # type: ignore[assignment]
        last = self._last_match
        if last is not None and last[0] is digests and last[1] is index and last[2] == index.version:
            return last[3]
        held = index.match(digests)
        self._last_match = (digests, index, index.version, held)
        return held

    def record(self, digests: list[int], now: float) -> int:
        """What was sent here; returns how many of its leading blocks the index held already."""
        if self.unanswered_since is None:
            self.unanswered_since = now
        return self.approx.record(digests)

    def forget(self, digests: list[int]) -> None:
        """Blocks recorded for a dispatch that did not go after all."""
        self.approx.forget(digests)

    def _precise(self) -> PreciseIndex:
        if self.precise is None:
            self.precise = PreciseIndex(self.block_size, self.approx.capacity)
        return self.precise

    def apply_events(self, events: list[KVEvent], now: float) -> None:
        """Events in the engine's own keys (vLLM's wire format, decoded)."""
        self._precise().apply(events, now)
        self.unanswered_since = None

    def apply_digests(self, stored: list[tuple[str, int]], removed: list[tuple[str, int]], now: float) -> None:
        """Events from an engine that keys blocks by our own digests (the simulator's model), as
        (medium, digest) pairs."""
        p = self._precise()
        for key in removed:
            p.remove(key)
        for key in stored:
            p.store(key, (key[1],))
        p.events += len(stored) + len(removed)
        p.last_event_at = now
        self.unanswered_since = None
