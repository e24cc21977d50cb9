"""Chained block hashes over token ids: the unit of prefix-cache identity.

A prompt is cut into fixed blocks of `block_size` tokens (16 by default, as vLLM on GPUs).
Block i's digest covers the whole prefix [0..i] because it hashes the parent digest together
with the block's own tokens, so equal digests mean equal prefixes and a replica's useful cache is
the *longest contiguous* run of digests it holds. Only full blocks get a digest: a partial tail
block can never be shared.

xxh3-64 is used because it is stable across processes and machines (unlike Python's `hash`),
and fast enough that hashing a prompt costs far less than tokenizing it.
"""

from __future__ import annotations

from array import array
from collections.abc import Container

import xxhash

DEFAULT_BLOCK_SIZE = 16
ROOT_HASH = 0  # parent digest of block 0; a per-model seed can be mixed in here later


def chain_block_hashes(token_ids: list[int] | array, block_size: int = DEFAULT_BLOCK_SIZE,
                       parent: int = ROOT_HASH) -> list[int]:
    """Digests of every full block of `token_ids`, each chained on the previous one."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = token_ids if isinstance(token_ids, array) else array("I", token_ids)
    raw = tokens.tobytes()
    step = block_size * tokens.itemsize
    digests: list[int] = []
    hasher = xxhash.xxh3_64_intdigest
    for start in range(0, (len(tokens) // block_size) * step, step):
        parent = hasher(raw[start:start + step], seed=parent)
        digests.append(parent)
    return digests


def prompt_digest(token_ids: list[int] | array) -> int:
    """One digest of the whole prompt, tail included: what a client's retry of it sends again."""
    tokens = token_ids if isinstance(token_ids, array) else array("I", token_ids)
    return xxhash.xxh3_64_intdigest(tokens.tobytes())


def leading_run(digests: list[int], held: Container[int]) -> int:
    """How many of `digests`, from the first, are in `held`: the usable cached prefix (chained
    digests make any block after a miss useless)."""
    n = 0
    for d in digests:
        if d not in held:
            break
        n += 1
    return n


def num_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold `num_tokens` tokens (a partial block still takes a whole one)."""
    return -(-num_tokens // block_size)
