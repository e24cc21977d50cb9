"""What prefix-cache identity costs per request: chained block hashes against tokenizing.

The gateway tokenizes every prompt anyway (to count tokens for the KV and context budgets), then
hashes its token ids in 16-token blocks (`bouncer.core.fleet.blocks`). The hashing must cost well
under the tokenizing, so that cache-aware routing adds nothing noticeable per request. Both are
timed here on the same 128k-token prompt, in the same process, with the bundled tokenizer (a
byte-level BPE; a model's own, larger vocabulary tokenizes somewhat slower, which only widens
the gap).
"""

from __future__ import annotations

import json
import pathlib
import random
import statistics
import time

from bouncer.core.fleet.blocks import DEFAULT_BLOCK_SIZE, chain_block_hashes
from bouncer.tokenizer import PromptTokenizer

WORDS = ("the request queue holds prompts while the fleet drains its backlog of prefill tokens and "
         "each replica keeps a prefix cache of blocks whose digests chain so that a shared system "
         "prompt or a long conversation history is computed once").split()


def _text_of(tokenizer: PromptTokenizer, tokens: int, seed: int) -> str:
    """Prose-like text that tokenizes to at least `tokens` tokens."""
    rng = random.Random(seed)
    words: list[str] = []
    while True:
        words.extend(rng.choice(WORDS) for _ in range(tokens // 2))
        text = " ".join(words)
        if len(tokenizer.encode(text)) >= tokens:
            return text


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(tokens: int = 131_072, repeats: int = 20, block_size: int = DEFAULT_BLOCK_SIZE, seed: int = 0) -> dict:
    tok = PromptTokenizer()
    text = _text_of(tok, tokens, seed)
    ids = tok.encode(text)
    tokenize_s = _median_s(lambda: tok.encode(text), repeats)
    hash_s = _median_s(lambda: chain_block_hashes(ids, block_size), repeats)
    return {"prompt_tokens": len(ids), "prompt_chars": len(text), "block_size": block_size,
            "blocks": len(ids) // block_size, "repeats": repeats, "tokenizer": str(tok.path.name),
            "tokenize_ms": round(1e3 * tokenize_s, 3), "hash_ms": round(1e3 * hash_s, 3),
            "hash_over_tokenize": round(hash_s / tokenize_s, 4)}


def main(tokens: int, repeats: int, out: str | None) -> dict:
    r = run(tokens, repeats)
    print(f"{r['prompt_tokens']:,}-token prompt ({r['blocks']:,} blocks of {r['block_size']}), median of "
          f"{r['repeats']}: tokenize {r['tokenize_ms']:.2f} ms, chained xxh3 block hashes {r['hash_ms']:.2f} ms "
          f"({r['hash_over_tokenize']:.1%} of tokenizing)")
    if out:
        pathlib.Path(out).write_text(json.dumps(r, indent=1) + "\n")
    return r
