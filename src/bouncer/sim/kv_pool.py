"""A paged KV-cache pool with a prefix cache, modelled on vLLM v1's block pool.

The pool has `num_blocks` blocks of `block_size` tokens. A block is either held (ref count > 0)
by one or more running requests, or free. Free blocks sit in one queue ordered for eviction
(least recently freed first); a free block that still carries a prefix digest stays findable in
the prefix cache until the allocator takes it for something else. That is vLLM's design: cached
blocks cost nothing until memory is needed, and usage counts only held blocks.

With `cpu_blocks`, a second tier models vLLM's native CPU offloading (`--kv-offloading-size`):
every block is copied to host memory once computed (write-through), kept there least-recently-used,
and a prefix found there is loaded back instead of recomputed (the engine charges the transfer).

Observers of the cache (a precise prefix router) can subscribe to events, which carry the same
chained digests that `bouncer.core.blocks` computes: `stored`/`removed` for the GPU tier,
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
        self._ref_cnt = [0] * num_blocks
        self._digest: list[int | None] = [None] * num_blocks
        # Eviction order: first key is evicted first. dict keeps O(1) removal from the middle,
        # needed when a cached free block is hit and becomes held again.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # digest -> block id

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks the allocator can hand out, cached-but-unreferenced ones included."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests: vLLM's `kv_cache_usage_perc`."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

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
        for block in blocks:
            if self._ref_cnt[block] == 0:
                del self._free[block]
            self._ref_cnt[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks, evicting cached free blocks in LRU order; None if fewer are free."""
        if n > len(self._free):
            return None
        out: list[int] = []
        removed: list[int] = []
        free = self._free
        for _ in range(n):
            block, _ = free.popitem(last=False)
            digest = self._digest[block]
            if digest is not None:
                self._digest[block] = None
                del self._cached[digest]
                removed.append(digest)
            self._ref_cnt[block] = 1
            out.append(block)
        if removed and self.event_sink is not None:
            self.event_sink("removed", removed)
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop a request's references. Blocks are freed tail first, so a request's last blocks
        (the least shareable) are evicted before its prefix, as vLLM does."""
        free = self._free
        for block in reversed(blocks):
            self._ref_cnt[block] -= 1
            if self._ref_cnt[block] == 0:
                free[block] = None

    def register(self, block: int, digest: int) -> None:
        """Make a fully computed block findable by its prefix digest."""
        if not self.enable_prefix_caching or self._digest[block] is not None:
            return
        if digest in self._cached:
            return  # another block already holds this prefix; keep one copy findable
        self._digest[block] = digest
        self._cached[digest] = block
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
