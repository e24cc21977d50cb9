"""Driving WEKA's kv-cache-tester (its trace replay; vendored in a checkout's
third_party/kv-cache-tester) against a gateway.

The tester runs as its own process from its own virtualenv (`.venv-kv-tester`: openai,
transformers, pandas, plotly), a client Bouncer did not write. It reads plain `*.json` Claude Code
sessions, so `run` unpacks the repository's gzipped ones, and it sizes its prompts with a Hugging
Face tokenizer: the same local folder of Bouncer's bundled tokenizer that guidellm is given.
"""

from __future__ import annotations

import csv
import gzip
import os
import pathlib
import subprocess
import urllib.request
from collections import Counter
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from bouncer.bench.guidellm import tokenizer_dir


@dataclass(frozen=True)
class TesterRun:
    log: str  # its stdout and stderr
    rows: list[dict[str, str]]  # detailed_results.csv: one per step sent
    lifecycle: Counter[str]  # user_lifecycle.csv's events; a subagent's (users named PARENT-SAn) as EVENT-subagent

    @property
    def served(self) -> list[dict[str, str]]:
        return [r for r in self.rows if r["success"] == "True"]


def run(python: pathlib.Path, tester: pathlib.Path, target: str, sessions: pathlib.Path, workdir: pathlib.Path,
        users: int, seconds: int, time_scale: float, seed: int, max_ttft_s: float, recycle: bool = False,
        timeout_s: float | None = None) -> TesterRun:
    """One run of `users` sessions from `sessions` (a folder of `*.json.gz`) at once, think times
    x `time_scale`, for `seconds`; the tester then waits for what is in flight. `recycle`: a
    session that ends is replaced by another (closed loop)."""
    traces = workdir / "traces"
    traces.mkdir(parents=True)
    for gz in sorted(sessions.glob("*.json.gz")):
        (traces / gz.name.removesuffix(".gz")).write_bytes(gzip.decompress(gz.read_bytes()))
    out = workdir / "results"
    proc = subprocess.run(
        [str(python), str(tester), "--api-endpoint", target, "--trace-directory", str(traces), "--output-dir", str(out),
         "--tokenizer", str(tokenizer_dir(workdir / "tokenizer")), "--start-users", str(users), "--max-users",
         str(users), "--max-ttft", str(max_ttft_s), "--time-scale", str(time_scale), "--test-duration", str(seconds),
         "--seed", str(seed), *(["--recycle"] if recycle else []), "--skip-graphs", "--no-color"],
        capture_output=True, text=True, timeout=timeout_s or seconds + 600, cwd=tester.parent,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    log = proc.stdout + proc.stderr
    (workdir / "tester.log").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"kv-cache-tester failed ({proc.returncode}):\n{log[-3000:]}")
    with open(out / "detailed_results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    with open(out / "user_lifecycle.csv", newline="") as f:
        lifecycle = Counter(e["event_type"] + ("-subagent" if "-SA" in e["user_id"] else "") for e in csv.DictReader(f))
    return TesterRun(log, rows, lifecycle)


def sessions_reuse(run: TesterRun) -> float | None:
    """The share of the served steps' prompt blocks that their sessions reuse (the trace's own
    cache-hit blocks): what a replica keeping each session can hit at most, warm prefix aside."""
    reused = sum(int(r["cache_hit_blocks"]) for r in run.served)
    blocks = reused + sum(int(r["cache_miss_blocks"]) for r in run.served)
    return reused / blocks if blocks else None


def prefix_hits(engine_urls: list[str]) -> tuple[float, float]:
    """The engines' prefix-cache hits and queries (vLLM's counters), summed."""
    hits = queries = 0.0
    for url in engine_urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            families = text_string_to_metric_families(resp.read().decode())
        for family in families:
            for s in family.samples:
                hits += s.value if s.name == "vllm:prefix_cache_hits_total" else 0
                queries += s.value if s.name == "vllm:prefix_cache_queries_total" else 0
    return hits, queries
