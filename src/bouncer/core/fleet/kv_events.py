"""KV-cache events from an engine, and the precise prefix index they build.

vLLM (`--kv-events-config`) publishes, once per scheduler step, which blocks became findable in
its prefix cache (`BlockStored`) and which were evicted (`BlockRemoved`, `AllBlocksCleared`).
The engine names blocks by its *own* hashes (vLLM: a per-process seeded hash over its own block
size), which we never try to reproduce. Instead, as llm-d's indexer does ("dual key"), a stored
block's token ids and its parent's engine key let us recompute *our* chained digests
(`bouncer.core.fleet.blocks`); engine keys are kept only to map later removals back to our digests.

Blocks may live in more than one tier (`medium`: the GPU, or host memory with vLLM's KV
offloading); a prefix held in any tier is reusable without recomputation, so the index answers
for all of them, keyed by (medium, engine key).

This module is pure: decoding the wire format belongs to `bouncer.kv_events_wire`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from bouncer.core.fleet.blocks import ROOT_HASH, chain_block_hashes, leading_run
from bouncer.core.fleet.cache_salt import salt_root


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[Hashable]  # engine keys, one per engine block, in prefix order
    parent_block_hash: Hashable | None  # engine key of the block before the first; None: prompt start
    token_ids: list[int]  # the blocks' tokens, block_size per block (may be empty for an offload copy)
    block_size: int  # the engine's block size in tokens
    medium: str = "GPU"
    salt: str | None = None  # the cache salt that keys a prompt's first block (vLLM's extra keys), and so its chain


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[Hashable]
    medium: str = "GPU"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class PreciseIndex:
    """Our block digests an engine holds in its prefix cache, as its events tell.

    An engine block of `k` times our block size maps to `k` of our digests. A stored block whose
    parent we never saw (we subscribed mid-stream, or missed events) cannot be placed in our
    chain and is counted in `unplaced` rather than guessed. `capacity` bounds memory should
    removals be lost: the oldest entries go first."""

    __slots__ = ("block_size", "capacity", "_ours", "_by_engine_key", "_media", "last_event_at", "events", "unplaced",
                 "version")

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self._ours: dict[int, int] = {}  # our digest (salted) -> engine blocks (in any tier) holding it
        # (medium, engine key) -> our digests before salting (a chain goes on from them), and the
        # root of the salt that keys them (`fleet.cache_salt`); insertion order = age
        self._by_engine_key: dict[tuple[str, Hashable], tuple[tuple[int, ...], int]] = {}
        self._media: list[str] = ["GPU"]  # tiers seen
        self.last_event_at: float | None = None
        self.events = 0
        self.unplaced = 0
        self.version = 0  # moves with every change of what it holds

    def __len__(self) -> int:
        return len(self._ours)

    def match(self, digests: list[int]) -> int:
        """Leading blocks of `digests` the engine holds."""
        return leading_run(digests, self._ours)

    def apply(self, events: Iterable[KVEvent], now: float) -> None:
        for ev in events:
            self.events += 1
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                for key in ev.block_hashes:
                    self.remove((ev.medium, key))
            else:
                self.clear()
        self.last_event_at = now

    def store(self, engine_key: tuple[str, Hashable], digests: tuple[int, ...], root: int = 0) -> None:
        """The engine block `engine_key` (medium, key) holds our blocks `digests`, keyed by a
        salt with root `root`."""
        if engine_key in self._by_engine_key:
            return
        self.version += 1
        self._by_engine_key[engine_key] = (digests, root)
        ours = self._ours
        for d in digests:
            d ^= root
            ours[d] = ours.get(d, 0) + 1
        while len(self._by_engine_key) > self.capacity:
            self.remove(next(iter(self._by_engine_key)))

    def remove(self, engine_key: tuple[str, Hashable]) -> None:
        held = self._by_engine_key.pop(engine_key, None)
        if held is None:
            return
        self.version += 1
        ours = self._ours
        digests, root = held
        for d in digests:
            d ^= root
            left = ours[d] - 1
            if left:
                ours[d] = left
            else:
                del ours[d]

    def clear(self) -> None:
        self.version += 1
        self._ours.clear()
        self._by_engine_key.clear()

    def _known(self, key: Hashable) -> tuple[tuple[int, ...], int] | None:
        """Our digests for an engine block (unsalted) and its salt's root, from whichever tier
        reported it."""
        for medium in self._media:
            held = self._by_engine_key.get((medium, key))
            if held is not None:
                return held
        return None

    def _stored(self, ev: BlockStored) -> None:
        if ev.medium not in self._media:
            self._media.append(ev.medium)
        if not ev.token_ids:  # an offload copy reported without tokens: the same block elsewhere
            for key in ev.block_hashes:
                held = self._known(key)
                if held is None:
                    self.unplaced += 1
                else:
                    self.store((ev.medium, key), *held)
            return
        per = ev.block_size // self.block_size
        if per < 1 or ev.block_size % self.block_size or len(ev.token_ids) < per * self.block_size * len(
                ev.block_hashes):
            self.unplaced += len(ev.block_hashes)  # cannot be cut into our blocks
            return
        if ev.parent_block_hash is None:  # a prompt's start: the salt that keys it, if any, keys its chain
            parent, root = ROOT_HASH, salt_root(ev.salt) if ev.salt else 0
        else:
            held = self._known(ev.parent_block_hash)
            if held is None:
                self.unplaced += len(ev.block_hashes)
                return
            parent, root = held[0][-1], held[1]
        digests = chain_block_hashes(ev.token_ids[: per * self.block_size * len(ev.block_hashes)],
                                     self.block_size, parent)
        for i, key in enumerate(ev.block_hashes):
            self.store((ev.medium, key), tuple(digests[i * per:(i + 1) * per]), root)
