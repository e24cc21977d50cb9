"""Approximate per-replica prefix index: which prompt blocks we believe a replica holds.

Built from what the gateway itself sent there (no engine cooperation needed), bounded by the
replica's KV capacity in blocks and aged out least-recently-used, like the engine's own cache.
A replica's useful cache for a prompt is the *longest contiguous* run of the prompt's chained
block digests from the start: a replica holding only later blocks scores zero.
"""

from __future__ import annotations

from collections import OrderedDict


class ApproxPrefixIndex:
    __slots__ = ("capacity", "_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks <= 0:
            raise ValueError("capacity_blocks must be positive")
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, digests: list[int]) -> int:
        """Leading blocks of `digests` believed cached here."""
        blocks = self._blocks
        n = 0
        for d in digests:
            if d not in blocks:
                break
            n += 1
        return n

    def record(self, digests: list[int]) -> None:
        """The prompt was sent here: its blocks become the most recently used."""
        blocks = self._blocks
        for d in digests:
            if d in blocks:
                blocks.move_to_end(d)
            else:
                blocks[d] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)
