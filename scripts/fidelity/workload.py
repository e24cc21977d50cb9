"""Generate a deterministic request stream (JSONL) for fidelity runs: real vLLM vs Bouncer's model.

Each line: {"id", "t" (s offset), "prompt" (text), "max_tokens", "prompt_tokens", "group",
"prefix_tokens"}. Only t/prompt/max_tokens are needed by replay.py; the rest documents the stream.

Shape (defaults): 80 requests; 40 arrive as a burst in the first second, the other 40 trickle in
as a Poisson stream at 1.5 req/s. Prompts are 150-400 tokens of words taken from the tokenizer's
own vocabulary. 75 % of requests belong to one of 5 groups; members of a group share a long common
prefix (128-300 tokens), so an engine with prefix caching gets hits (vLLM's CPU backend caches in
128-token blocks). Prompt length + max_tokens never exceeds --max-model-len. Token counts use
src/bouncer/data/tokenizer.json; the prefix boundary is a word boundary, so the shared text is also
a shared token prefix.

    .venv/bin/python scripts/fidelity/workload.py --out scripts/fidelity/workload.jsonl
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

from tokenizers import Tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER_JSON = REPO / "src/bouncer/data/tokenizer.json"


def word_pool(tok: Tokenizer) -> list[str]:
    """Space-prefixed alphabetic vocabulary entries (" return", " self", ...) that encode to 1 token."""
    words = []
    for piece in sorted(tok.get_vocab()):
        if piece.startswith("Ġ") and piece[1:].isascii() and piece[1:].isalpha() and len(piece) >= 4:
            w = " " + piece[1:]
            if len(tok.encode(w).ids) == 1:
                words.append(w)
    return words


def grow(tok: Tokenizer, rng: random.Random, words: list[str], start: str, target: int) -> str:
    """Append random words to `start` until it encodes to exactly `target` tokens (or just under)."""
    text = start
    n = len(tok.encode(text).ids) if text else 0
    while n < target:
        cand = text + rng.choice(words)
        m = len(tok.encode(cand).ids)
        if m > target:
            continue  # a word that merged into 2+ tokens would overshoot; try another
        text, n = cand, m
    return text


def generate(n: int, seed: int, burst: int, burst_window: float, rate: float, groups: int,
             group_frac: float, min_prompt: int, max_prompt: int, min_out: int, max_out: int,
             max_model_len: int) -> list[dict]:
    tok = Tokenizer.from_file(str(TOKENIZER_JSON))
    rng = random.Random(seed)
    words = word_pool(tok)
    prefixes = []
    for g in range(groups):
        plen = rng.randint(128, 300)
        prefixes.append(grow(tok, rng, words, f"Group {g} instructions:", plen))
    times = sorted(rng.uniform(0.0, burst_window) for _ in range(burst))
    t = burst_window
    while len(times) < n:
        t += rng.expovariate(rate)
        times.append(t)
    out = []
    for i, t in enumerate(times):
        group = rng.randrange(groups) if rng.random() < group_frac else None
        if group is None:
            start = f"Request {i}:"
            prefix_tokens = 0
        else:
            start = prefixes[group]
            prefix_tokens = len(tok.encode(start).ids)
        target = max(rng.randint(min_prompt, max_prompt), prefix_tokens + 16)
        prompt = grow(tok, rng, words, start + (f" Request {i}:" if group is not None else ""), target)
        ptoks = len(tok.encode(prompt).ids)
        max_tokens = min(rng.randint(min_out, max_out), max_model_len - ptoks)
        assert max_tokens >= 1 and tok.encode(prompt).ids[:prefix_tokens] == tok.encode(start).ids[:prefix_tokens]
        out.append({"id": i, "t": round(t, 4), "prompt": prompt, "max_tokens": max_tokens,
                    "prompt_tokens": ptoks, "group": group, "prefix_tokens": prefix_tokens})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "scripts/fidelity/workload.jsonl"))
    ap.add_argument("--n", type=int, default=80)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--burst", type=int, default=40, help="requests in the initial burst")
    ap.add_argument("--burst-window", type=float, default=1.0, help="seconds the burst is spread over")
    ap.add_argument("--rate", type=float, default=1.5, help="trickle arrival rate (req/s, Poisson)")
    ap.add_argument("--groups", type=int, default=5)
    ap.add_argument("--group-frac", type=float, default=0.75)
    ap.add_argument("--min-prompt", type=int, default=150)
    ap.add_argument("--max-prompt", type=int, default=400)
    ap.add_argument("--min-out", type=int, default=32)
    ap.add_argument("--max-out", type=int, default=160)
    ap.add_argument("--max-model-len", type=int, default=512)
    a = ap.parse_args()
    reqs = generate(a.n, a.seed, a.burst, a.burst_window, a.rate, a.groups, a.group_frac,
                    a.min_prompt, a.max_prompt, a.min_out, a.max_out, a.max_model_len)
    path = pathlib.Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in reqs:
            f.write(json.dumps(r) + "\n")
    pt = [r["prompt_tokens"] for r in reqs]
    mt = [r["max_tokens"] for r in reqs]
    print(f"wrote {path}: {len(reqs)} requests over {reqs[-1]['t']:.1f} s; prompt tokens "
          f"{min(pt)}-{max(pt)} (sum {sum(pt)}); max_tokens {min(mt)}-{max(mt)} (sum {sum(mt)}); "
          f"grouped {sum(r['group'] is not None for r in reqs)}")


if __name__ == "__main__":
    main()
