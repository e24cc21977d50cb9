"""`bouncer bench hashing`: both costs measured on the same prompt, and saved."""

from __future__ import annotations

import json
import subprocess
import sys

from bouncer.core.fleet.blocks import chain_block_hashes
from bouncer.tokenizer import PromptTokenizer


def test_hashing_bench_times_the_prompt_it_tokenized(tmp_path):
    out = tmp_path / "h.json"
    proc = subprocess.run([sys.executable, "-m", "bouncer", "bench", "hashing", "--tokens", "4096", "--repeats", "3",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["prompt_tokens"] >= 4096 and r["blocks"] == r["prompt_tokens"] // 16
    assert r["tokenize_ms"] > 0 and r["hash_ms"] > 0
    assert abs(r["hash_over_tokenize"] - r["hash_ms"] / r["tokenize_ms"]) < 0.01
    assert "of tokenizing" in proc.stdout


def test_block_hashes_of_a_tokenized_prompt_share_its_prefix():
    tok = PromptTokenizer()
    a = tok.encode("the same long system prompt " * 40 + "then one question " * 20)
    b = tok.encode("the same long system prompt " * 40 + "then entirely different words " * 20)
    ha, hb = chain_block_hashes(a), chain_block_hashes(b)
    shared = next(i for i, (x, y) in enumerate(zip(ha, hb, strict=False)) if x != y)
    assert shared >= 10 and ha[:shared] == hb[:shared]
