"""What the router believes each replica holds in its prefix cache.

Two sources, one view per replica (`ReplicaPrefixIndex`):
- approximate: what the gateway itself sent there (no engine cooperation needed), bounded by the
  replica's KV capacity in blocks and aged out least-recently-used, like the engine's own cache;
- precise: the engine's KV events (`bouncer.core.fleet.kv_events`), used while they flow.

A replica's useful cache for a prompt is the *longest contiguous* run of the prompt's chained
block digests from the start: a replica holding only later blocks scores zero.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import repeat

from bouncer.core.fleet.blocks import leading_run
from bouncer.core.fleet.kv_events import KVEvent, PreciseIndex


class ApproxPrefixIndex:
    """Blocks held least-recently-used first, in the order an `OrderedDict` moved to its end at
    every `record` would keep them, at a cost that follows what is new rather than the prompt.

    An agent's step resends its whole conversation (8,500 blocks at 130k tokens) and adds a few
    dozen blocks; walking every block in `match` and moving every one in `record` made this index
    the largest cost of such a step in the gateway. So the LRU order is kept per record rather
    than per block: `_records` lists the records oldest first, each with its blocks and an owner
    cell, and a block belongs to the record whose cell it points to (`_owner`); entries left
    behind in older records are stale, skipped when evicting and compacted away. Each record's
    last two blocks are remembered (`_tails`), which gives two shortcuts for a prompt that extends
    one recorded before: it is held up to there without a lookup per block, as long as eviction
    has not reached that record since (eviction takes the oldest records first, so that is one
    comparison of ticks); and recording it takes over that record's cell, which moves all its
    blocks to the end at once. Two, because a chat prompt ends with the generation prompt,
    which the next step's prompt carries as the start of the assistant's answer, tokenized
    with what follows: the previous prompt's last block may not be the next one's."""

    __slots__ = ("capacity", "_owner", "_records", "_recorded", "_tails", "_tick", "_evicted_upto", "version")

    # how far back from a prompt's end to look for the end of a recorded prompt it extends (in
    # blocks; 16k tokens of 16): past it, or for prompts under SHORTCUT_MIN blocks, blocks are walked
    PROBE_BLOCKS = 1024
    SHORTCUT_MIN = 64
    # entries kept, stale ones included, before they are compacted, per block the index may hold
    COMPACT_RATIO = 2.0

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity = capacity_blocks
        self._owner: dict[int, object] = {}  # block -> its record's cell (an object of its own)
        # record tick -> [its blocks, the first not yet evicted, its cell], oldest first; a cell is
        # in one record at most, and an entry whose block points elsewhere is stale
        self._records: OrderedDict[int, list] = OrderedDict()
        self._recorded = 0  # entries in _records from their first not yet evicted, stale ones included
        # a record's last two blocks -> (blocks up to there, the record's tick)
        self._tails: dict[int, tuple[int, int]] = {}
        self._tick = 0
        self._evicted_upto = 0  # records at or before this tick may have lost blocks
        self.version = 0  # moves with every change of what it holds (`ReplicaPrefixIndex.match` remembers by it)

    def __len__(self) -> int:
        return len(self._owner)

    def match(self, digests: list[int]) -> int:
        """Leading blocks of `digests` believed cached here."""
        return self._held(digests)[1]

    def _held(self, digests: list[int]) -> tuple[tuple[int, int] | None, int]:
        """The recorded prompt `digests` extends (`_extends`), and how many of its leading blocks
        are held."""
        held = self._owner
        if not digests or digests[0] not in held:
            return None, 0
        extended = self._extends(digests)
        known = 0 if extended is None else extended[0]
        return extended, known + leading_run(digests[known:] if known else digests, held)

    def _extends(self, digests: list[int]) -> tuple[int, int] | None:
        """(length, tick) of the longest recorded prompt that `digests` extends and that is
        still held whole (chained digests: the same block at the same place is the same prefix)."""
        n = len(digests)
        if n < self.SHORTCUT_MIN:
            return None
        tails, evicted_upto = self._tails, self._evicted_upto
        for i in range(n - 1, max(0, n - self.PROBE_BLOCKS) - 1, -1):
            tail = tails.get(digests[i])
            if tail is not None and tail[0] == i + 1 and tail[1] > evicted_upto:
                return tail
        return None

    def record(self, digests: list[int]) -> int:
        """The prompt was sent here: its blocks become the most recently used. Returns how many
        of its leading blocks were held already (the rest are new here)."""
        self.version += 1
        if not digests:
            return 0
        held = self._owner
        # the chain's digests are distinct: what was held before is what `record` would find block by block
        extended, found = self._held(digests)
        known = 0 if extended is None else extended[0]
        self._tick = tick = self._tick + 1
        digests = list(digests)  # kept in the LRU order: the caller's list may change
        taken = self._records.get(extended[1]) if extended is not None else None
        if taken is None:
            cell = object()
            held.update(zip(digests, repeat(cell)))
        else:
            cell = self._take_over(extended[1], taken, digests, known)
            held.update(zip(digests[known:], repeat(cell)))
        self._records[tick] = [digests, 0, cell]
        self._recorded += len(digests)
        tails = self._tails
        tails[digests[-1]] = (len(digests), tick)
        if len(digests) > 1:
            tails[digests[-2]] = (len(digests) - 1, tick)
        if len(held) > self.capacity:
            self._evict()
        if (self._recorded > self.COMPACT_RATIO * max(self.capacity, len(held))
                or len(self._tails) > 4 * len(self._records) + 64):  # (ends of records gone, left by eviction)
            self._compact()
        return found

    def _take_over(self, old_tick: int, taken: list, digests: list[int], known: int) -> object:
        """The record `old_tick`, whose first `known` blocks `digests` starts with, gives them
        to the record `digests` is becoming, moved to the end whole; its cell is returned. Of
        its blocks, only a leading run can belong to a later record (one that shared a prefix
        with it): those come back one by one. Its last block, where `digests` parts from it
        there, stays where it was, in its place in the order."""
        held, tails = self._owner, self._tails
        old, start, cell = taken
        self._recorded -= len(old) - start
        last = old[-1]  # (its own list may be compacted: it is the record's last block if it is live)
        if held.get(last) is cell and last != digests[known - 1]:
            left = held[last] = object()
            self._records[old_tick] = [[last], 0, left]
            self._recorded += 1
        else:
            del self._records[old_tick]
        for d in digests[max(0, known - 2):known]:  # its remembered ends, where they are this prompt's
            if tails.get(d, (0, 0))[1] == old_tick:
                del tails[d]
        for d in digests[:known]:  # (the prompt has them all, where the record's list may be compacted)
            if held[d] is cell:
                break
            held[d] = cell
        return cell

    def forget(self, digests: list[int]) -> None:
        """What `record` added was not sent after all (a claim that failed, `core.claims`)."""
        self.version += 1
        for d in digests:
            self._owner.pop(d, None)
        self._evicted_upto = self._tick  # blocks left any record: no recorded end vouches for its prefix

    def _evict(self) -> None:
        held, records, tails = self._owner, self._records, self._tails
        excess = len(held) - self.capacity
        while excess > 0:
            tick, rec = next(iter(records.items()))
            digests, i, cell = rec
            if tick > self._evicted_upto:  # (a `forget` may have set it later already)
                self._evicted_upto = tick
            start = i
            while i < len(digests) and excess > 0:
                d = digests[i]
                if held.get(d) is cell:
                    del held[d]
                    excess -= 1
                i += 1
            self._recorded -= i - start
            if i == len(digests):
                records.popitem(last=False)
                for d in digests[-2:]:
                    if tails.get(d, (0, 0))[1] == tick:
                        del tails[d]
            else:
                rec[1] = i

    def _compact(self) -> None:
        """Drop the stale entries, keeping the order of the rest."""
        held, kept = self._owner, OrderedDict()
        for tick, (digests, i, cell) in self._records.items():
            live = [d for d in digests[i:] if held.get(d) is cell]
            if live:
                kept[tick] = [live, 0, cell]
        self._records = kept
        self._recorded = sum(len(r[0]) for r in kept.values())
        # a record whose last block went elsewhere no longer ends there
        self._tails = {d: t for d, t in self._tails.items()
                       if t[1] in kept and held.get(d) is kept[t[1]][2]}


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
