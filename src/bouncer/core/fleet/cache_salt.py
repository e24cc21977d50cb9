"""Tenants' prefix caches apart: each tenant's prompts in a cache of its own on the engine.

An engine's prefix cache is shared by whoever sends the same prompt prefix, and a prompt that
finds its prefix cached answers sooner: another tenant can time its requests to learn what was
asked before (the timing channel of CVE-2025-46570). vLLM keys its cache by a request's
`cache_salt` too, so the gateway sets one on every request (`cache_isolation`, on by default,
overwriting any a client sent): its tenant's, or its tenant group's (`Tenant.cache_group`: tenants
that share a system prompt may share its cache).

The gateway keeps its own index of what each replica holds (`prefix_index`, KV events) in the
same terms: a block's digest is its prefix's digest (`blocks.chain_block_hashes`) mixed with the
salt's root, so a salted prompt finds only its own group's blocks, as the engine will. Mixing by
XOR keeps the chain's property (equal digests, equal prefixes) and costs nothing per token.

The salt is derived from the group's name, not a secret: clients cannot set it (the gateway
overwrites theirs), and a client that could reach an engine directly would pass every other
check of the gateway too.
"""

from __future__ import annotations

import base64
import hashlib

import xxhash

# engines that take a `cache_salt` per request (vLLM since 0.9); others share their cache, and
# the index does not pretend otherwise
SALTED_ENGINES = frozenset({"vllm"})


def salt_of(group: str) -> str:
    """The cache salt of a tenant group: short, and of the characters vLLM accepts."""
    digest = hashlib.sha256(b"bouncer-cache-salt\0" + group.encode()).digest()[:24]
    return base64.urlsafe_b64encode(digest).decode()


def salt_root(salt: str) -> int:
    """What a salt mixes into the digests of the blocks it keys."""
    return xxhash.xxh3_64_intdigest(salt.encode())


def salted(digests: list[int], root: int) -> list[int]:
    """Block digests as a salt with root `root` keys them (root 0: unsalted, the same list)."""
    return [d ^ root for d in digests] if root else digests
