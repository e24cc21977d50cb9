"""A paged KV-cache pool with a prefix cache, modelled on vLLM v1's block pool.

The pool has `num_blocks` blocks of `block_size` tokens. A block is either held by one or more
running requests, or free. Free blocks sit in one queue ordered for eviction (least recently
freed first); a free block that still carries a prefix digest stays findable in the prefix
cache until the allocator takes it for something else. That is vLLM's design: cached
blocks cost nothing until memory is needed, and usage counts only held blocks.

With `cpu_blocks`, a second tier models vLLM's native CPU offloading (`--kv-offloading-size`):
every block is copied to host memory once computed (write-through), kept there least-recently-used,
and a prefix found there is loaded back instead of recomputed (the engine charges the transfer).

Observers of the cache (a precise prefix router) can subscribe to events, which carry the same
chained digests that `bouncer.core.fleet.blocks` computes: `stored`/`removed` for the GPU tier,
`offloaded`/`dropped` for the CPU tier.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

# (kind, digests): kind is "stored" / "removed" (GPU tier) or "offloaded" / "dropped" (CPU tier)
KVEventSink = Callable[[str, list[int]], None]


class KVPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 event_sink: KVEventSink | None = None, cpu_blocks: int = 0) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if cpu_blocks < 0:
            raise ValueError("cpu_blocks must not be negative")
        self.cpu_blocks = cpu_blocks if enable_prefix_caching else 0
        self._cpu: OrderedDict[int, None] = OrderedDict()  # offloaded digests, least recently used first
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.event_sink = event_sink
        # A held block has one reference, plus these for blocks shared through the prefix cache:
        # most blocks are never shared, so allocating and releasing them writes no count.
        self._extra_refs: dict[int, int] = {}
        self._digest: list[int | None] = [None] * num_blocks
        # The free blocks in eviction order (what an OrderedDict would keep) are the entries of
        # _queue from _head on, less stale ones: a free block hit in the prefix cache is held
        # again, and its entry is skipped when the head reaches it rather than removed from the
        # middle. Stale entries of a block precede its live one, so counting them per block is
        # enough to tell them apart. Allocating and releasing are then slices, with no work per
        # block unless the blocks carry digests.
        self._queue: list[int] = list(range(num_blocks))
        self._head = 0
        self._stale: dict[int, int] = {}  # block -> its stale entries from _head on
        self._num_free = num_blocks
        self._cached: dict[int, int] = {}  # digest -> block id
        # 1 where a block is free; kept true for the blocks that carry a digest, the only ones
        # asked about (prefix hits), so that a workload without prefixes never writes it
        self._is_free = bytearray(b"\1") * num_blocks

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks the allocator can hand out, cached-but-unreferenced ones included."""
        return self._num_free

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests: vLLM's `kv_cache_usage_perc`."""
        return 1.0 - self._num_free / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def count_free(self, blocks: list[int]) -> int:
        """How many of `blocks` (cached ones) are free: taking them uses up free blocks."""
        return sum(map(self._is_free.__getitem__, blocks))

    def offloaded_run(self, digests: list[int], start: int) -> int:
        """How many of `digests`, from index `start` on, the CPU tier holds contiguously."""
        cpu = self._cpu
        n = 0
        for d in digests[start:]:
            if d not in cpu:
                break
            cpu.move_to_end(d)
            n += 1
        return n

    def longest_cached_prefix(self, digests: list[int]) -> list[int]:
        """Block ids of the longest contiguous run of `digests` present in the cache."""
        if not self.enable_prefix_caching:
            return []
        hit: list[int] = []
        cached = self._cached
        for digest in digests:
            block = cached.get(digest)
            if block is None:
                break
            hit.append(block)
        return hit

    # -- mutations ----------------------------------------------------------------------------
    def acquire(self, blocks: Iterable[int]) -> None:
        """Take a reference on cached blocks a request reuses (prefix hit)."""
        is_free = self._is_free
        extra = self._extra_refs
        stale = self._stale
        for block in blocks:
            if is_free[block]:  # leaves the eviction queue
                is_free[block] = 0
                stale[block] = stale.get(block, 0) + 1
                self._num_free -= 1
            else:
                extra[block] = extra.get(block, 0) + 1
        if len(self._queue) - self._head > 2 * self.num_blocks:
            self._compact()

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting cached free blocks in LRU order; None if fewer are free."""
        if n > self._num_free:
            return None
        head = self._head
        out = self._queue[head:head + n]
        if self._stale and not self._stale.keys().isdisjoint(out):
            out = self._take_live(n)
        else:
            self._head = head + n
        self._num_free -= n
        if self._cached:  # (else no free block carries a digest)
            self._evict(out)
        if self._head > self.num_blocks:  # drop the consumed entries now and then
            del self._queue[:self._head]
            self._head = 0
        return out

    def _compact(self) -> None:
        """Drop the stale entries, once they outnumber the blocks: the head may be slow to
        reach them when blocks are hit in the cache far more often than allocated."""
        self._queue = self._take_live(self._num_free)
        self._head = 0
        self._stale.clear()  # (those left were behind the last live entry)

    def _take_live(self, n: int) -> list[int]:
        """The next n free blocks from the head, skipping stale entries."""
        queue, stale = self._queue, self._stale
        i = self._head
        out: list[int] = []
        while len(out) < n:
            block = queue[i]
            if _uncounted(stale, block):
                out.append(block)
            i += 1
        self._head = i
        return out

    def _evict(self, blocks: list[int]) -> None:
        """Forget the prefixes that newly allocated `blocks` held."""
        digest_of = self._digest
        removed: list[int] = []
        for block in blocks:
            digest = digest_of[block]
            if digest is not None:
                digest_of[block] = None
                del self._cached[digest]
                removed.append(digest)
        if removed and self.event_sink is not None:
            self.event_sink("removed", removed)

    def release(self, blocks: list[int]) -> None:
        """Drop a request's references. Blocks are freed tail first, so a request's last blocks
        (the least shareable) are evicted before its prefix, as vLLM does."""
        extra = self._extra_refs
        if extra and not extra.keys().isdisjoint(blocks):
            freed = [block for block in reversed(blocks) if _uncounted(extra, block)]
        else:  # the common case: nothing shared, all are freed
            freed = blocks[::-1]
        if self._cached:
            is_free = self._is_free
            for block in freed:
                is_free[block] = 1
        self._queue.extend(freed)
        self._num_free += len(freed)

    def register(self, block: int, digest: int) -> None:
        """Make a fully computed block findable by its prefix digest."""
        if not self.enable_prefix_caching or self._digest[block] is not None:
            return
        if digest in self._cached:
            return  # another block already holds this prefix; keep one copy findable
        self._digest[block] = digest
        self._cached[digest] = block
        self._is_free[block] = 0  # (held by the request that computed it)
        if self.event_sink is not None:
            self.event_sink("stored", [digest])
        if self.cpu_blocks:
            self._offload(digest)

    def _offload(self, digest: int) -> None:
        cpu = self._cpu
        if digest in cpu:
            cpu.move_to_end(digest)
            return
        cpu[digest] = None
        dropped = []
        while len(cpu) > self.cpu_blocks:
            dropped.append(cpu.popitem(last=False)[0])
        if self.event_sink is not None:
            self.event_sink("offloaded", [digest])
            if dropped:
                self.event_sink("dropped", dropped)

    def reset_prefix_cache(self) -> None:
        removed = [d for d in self._cached]
        for block in self._cached.values():
            self._digest[block] = None
        self._cached.clear()
        if removed and self.event_sink is not None:
            self.event_sink("removed", removed)


def _uncounted(counts: dict[int, int], block: int) -> bool:
    """True when `block` has no count left; otherwise use up one of its counts (a stale queue
    entry skipped, or a shared reference dropped)."""
    n = counts.get(block)
    if n is None:
        return True
    if n == 1:
        del counts[block]
    else:
        counts[block] = n - 1
    return False
