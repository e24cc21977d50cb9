"""Token ids of chat segments, cached: an agent's next step sends its whole conversation again,
and only its new messages should need tokenizing.

A segment is one message as the chat template renders it (`<s>role\\ncontent</s>\\n`), or the
generation prompt at the end. The cache is exact, not an estimate: the template brackets every
message with special tokens, and the tokenizer cuts its input at special tokens before it
normalizes or pre-tokenizes anything, so no token spans two segments and a prompt's ids are the
concatenation of its segments' ids. `PromptTokenizer` uses the cache only where the tokenizer
is of a kind for which that holds (`segments_are_independent`), and tests compare it with full
tokenization on conversations built to break it.

Bounded by the tokens it holds (4 bytes each) and by its entries, least recently used first out.
Segments are keyed by a 128-bit digest of their text. The gateway tokenizes long prompts on
worker threads, so the cache takes a lock.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

import xxhash

DEFAULT_MAX_TOKENS = 4_000_000  # 16 MB of token ids
DEFAULT_MAX_ENTRIES = 200_000
DEFAULT_MAX_DIGESTS = 1_000_000  # block digests of conversations' prefixes kept: 8 MB


def segment_key(text: str) -> int:
    return xxhash.xxh3_128_intdigest(text.encode("utf-8", "surrogatepass"))


def prefix_keys(keys: list[int]) -> list[int]:
    """For each segment, one key of all the segments up to it (a conversation's prefix)."""
    out, rolling = [], 0
    for key in keys:
        rolling = xxhash.xxh3_64_intdigest(key.to_bytes(16, "little"), seed=rolling)
        out.append(rolling)
    return out


def segments_are_independent(tokenizer_json: dict, markers: tuple[str, ...]) -> bool:
    """Whether tokenizing text cut at `markers` piece by piece gives the ids of tokenizing it
    whole: the markers are special added tokens (the tokenizer splits at them first) and nothing
    after that looks at where the whole input starts (no normalizer; a byte-level or
    whitespace pre-tokenizer, not one that marks only the input's first word)."""
    special = {t["content"] for t in tokenizer_json.get("added_tokens", []) if t.get("special")}
    if not all(m in special for m in markers):
        return False
    if tokenizer_json.get("normalizer") is not None:
        return False
    pre = tokenizer_json.get("pre_tokenizer") or {}
    return pre.get("type") in ("ByteLevel", "Whitespace", "WhitespaceSplit")


class SegmentCache:
    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_tokens = max_tokens
        self.max_entries = max_entries
        self._ids: OrderedDict[int, array] = OrderedDict()
        self.tokens = 0
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, key: int) -> array | None:
        with self._lock:
            ids = self._ids.get(key)
            if ids is None:
                self.misses += 1
                return None
            self._ids.move_to_end(key)
            self.hits += 1
            return ids

    def put(self, key: int, ids: array) -> None:
        if len(ids) > self.max_tokens:
            return
        with self._lock:
            old = self._ids.pop(key, None)
            if old is not None:
                self.tokens -= len(old)
            self._ids[key] = ids
            self.tokens += len(ids)
            while self.tokens > self.max_tokens or len(self._ids) > self.max_entries:
                _, evicted = self._ids.popitem(last=False)
                self.tokens -= len(evicted)


class PrefixBlocks:
    """The block digests of conversations' prefixes: a prefix (all a prompt's messages, without
    the generation prompt) -> (its token count, the digests of its full blocks). The next step of
    the conversation starts with that prefix, so it hashes only the blocks after it. Bounded by
    the digests it holds; the gateway's threads share it (a lock)."""

    def __init__(self, max_digests: int = DEFAULT_MAX_DIGESTS) -> None:
        self.max_digests = max_digests
        self._blocks: OrderedDict[tuple[int, int], tuple[int, array]] = OrderedDict()
        self.digests = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: int, block_size: int) -> tuple[int, array] | None:
        with self._lock:
            found = self._blocks.get((key, block_size))
            if found is not None:
                self._blocks.move_to_end((key, block_size))
            return found

    def put(self, key: int, block_size: int, tokens: int, digests: array) -> None:
        if len(digests) > self.max_digests:
            return
        with self._lock:
            old = self._blocks.pop((key, block_size), None)
            if old is not None:
                self.digests -= len(old[1])
            self._blocks[(key, block_size)] = (tokens, digests)
            self.digests += len(digests)
            while self.digests > self.max_digests:
                _, (_, evicted) = self._blocks.popitem(last=False)
                self.digests -= len(evicted)
