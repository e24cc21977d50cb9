"""`bouncer bench long-prompts`: what an agent's step costs the gateway when its prompt is long.

Agent sessions send their whole conversation at every step, each step's prompt extending the
previous one (as the WEKA Claude Code traces do), here from about 10k to 130k tokens. A fast
upstream (bouncer.bench.fast_upstream) answers at once, so what is measured is the gateway: two
gateways in front of it, one with the chat-segment token cache (`tokenizer_cache_tokens`, the
default) and one without, each pinned to its own core where `taskset` exists, with the bundled
tokenizer. Every step goes to both and straight to the upstream; the report gives, per prompt
size and for a session's first step against the steps that extend one, the gateway's CPU per
request (its threads' time on CPU, from /proc/PID/task/*/schedstat, in nanoseconds) and the
latency it adds over going direct. Each gateway's prompt-token count for each request (its
access log) is checked against a full tokenization done here.
"""

from __future__ import annotations

import json
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass

from bouncer.bench.loopback import cpu_seconds, free_port, pinned, stop, wait_ok
from bouncer.config import key_digest
from bouncer.tokenizer import PromptTokenizer, default_tokenizer_path, render_chat

KEY = "bench-key"
WORDS = ("def", "return", "self", "import", "test", "assert", "error", "value", "config", "request", "tokens",
         "replica", "queue", "the", "a", "of", "to", "in", "is", "None", "True", "False", "async", "await",
         "for", "if", "else", "print", "FAILED", "passed", "line", "file", "path", "src/", "tests/", ".py")
BUCKETS = ((0, 30_000), (30_000, 60_000), (60_000, 100_000), (100_000, 10**9))


@dataclass
class Step:
    session: int
    step: int
    prompt_tokens: int  # a full tokenization's count, done here
    first: bool  # the session's first step (nothing of it cached)
    added_tokens: int  # what it adds to the session's previous step (its whole prompt for a first step)
    cpu_ms_cached: float
    cpu_ms_uncached: float
    added_ms_cached: float
    added_ms_uncached: float
    counts_match: bool  # both gateways counted exactly prompt_tokens


def _text(rng: random.Random, words: int) -> str:
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(WORDS) if rng.random() < 0.8 else f"x{rng.randrange(10**6)}")
        if len(line) >= 12:
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines + [" ".join(line)])


def sessions(n: int, steps: int, small_steps: int = 5, seed: int = 0) -> list[list[list[dict]]]:
    """`n` sessions: `steps` steps that each add a tool result and the assistant's next turn of
    about 10k tokens (with the bundled tokenizer), from about 13k to 130k, then `small_steps`
    that add about 1k each, as most steps of a real agent do."""
    rng = random.Random(seed)
    out = []
    for s in range(n):
        messages = [{"role": "system", "content": f"session {s}: you are a coding agent.\n" + _text(rng, 1200)}]
        session = []
        for i in range(steps + small_steps):
            words = (3300, 400) if i < steps else (330, 40)
            messages = messages + [{"role": "user", "content": "tool result:\n" + _text(rng, words[0])},
                                   {"role": "assistant", "content": _text(rng, words[1])}]
            session.append(messages)
        out.append(session)
    return out


def _post(url: str, body: bytes) -> float:
    req = urllib.request.Request(url, data=body, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}")
    return time.perf_counter() - t0


def _config(upstream: str, port: int, cache_tokens: int, log: pathlib.Path) -> dict:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "logging": {"format": "json", "level": "info"},
        "recorder": {"enabled": False},
        "tenants": [{"name": "agent", "api_keys_sha256": [key_digest(KEY)], "max_tokens_cap": 1024}],
        "models": [{"name": "fast", "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                    "tokenizer_cache_tokens": cache_tokens, "max_model_len": 262_144,
                    "backends": [{"url": upstream}]}],
        "limits": {"max_body_bytes": 16 * 1024 * 1024},
    }


def _logged_counts(log: pathlib.Path) -> list[int]:
    counts = []
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "request" and "prompt_tokens" in rec:
            # the gateway's own count (the line's prompt_tokens is the engine's, where it said otherwise)
            counts.append(rec.get("prompt_tokens_counted", rec["prompt_tokens"]))
    return counts


def run(n_sessions: int = 3, steps: int = 13, small_steps: int = 5, seed: int = 0) -> list[Step]:
    full = PromptTokenizer(segment_cache=False)
    plan = sessions(n_sessions, steps, small_steps, seed)
    up_port, on_port, off_port = free_port(), free_port(), free_port()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        logs = {"on": work / "on.log", "off": work / "off.log"}
        try:
            procs.append(subprocess.Popen([*pinned(0), sys.executable, "-m", "bouncer.bench.fast_upstream",
                                           "--port", str(up_port)]))
            for name, port, cache in (("on", on_port, 4_000_000), ("off", off_port, 0)):
                (work / f"{name}.yaml").write_text(json.dumps(_config(f"http://127.0.0.1:{up_port}", port, cache,
                                                                      logs[name])))
                with open(logs[name], "w") as log:
                    procs.append(subprocess.Popen([*pinned(1), sys.executable, "-m", "bouncer", "serve", "--config",
                                                   str(work / f"{name}.yaml")], stdout=log, stderr=log))
            wait_ok(f"http://127.0.0.1:{up_port}/metrics")
            wait_ok(f"http://127.0.0.1:{on_port}/ready")
            wait_ok(f"http://127.0.0.1:{off_port}/ready")
            pids = {"on": procs[1].pid, "off": procs[2].pid}
            urls = {"on": f"http://127.0.0.1:{on_port}/v1/chat/completions",
                    "off": f"http://127.0.0.1:{off_port}/v1/chat/completions",
                    "direct": f"http://127.0.0.1:{up_port}/v1/chat/completions"}
            warm = json.dumps({"model": "fast", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]})
            for url in urls.values():
                _post(url, warm.encode())
            out = []
            for s, session in enumerate(plan):
                previous = 0
                for i, messages in enumerate(session):
                    body = json.dumps({"model": "fast", "max_tokens": 256, "messages": messages}).encode()
                    direct = _post(urls["direct"], body)
                    cpu, wall = {}, {}
                    for name in ("on", "off"):
                        before = cpu_seconds(pids[name])
                        wall[name] = _post(urls[name], body)
                        time.sleep(0.05)  # the access log line and the permit's release land after the answer
                        cpu[name] = (cpu_seconds(pids[name]) - before) * 1e3
                    tokens = len(full.encode(render_chat(messages)))
                    out.append(Step(s, i, tokens, i == 0, tokens - previous, cpu["on"], cpu["off"],
                                    (wall["on"] - direct) * 1e3, (wall["off"] - direct) * 1e3, True))
                    previous = tokens
            time.sleep(0.5)
            logged = {name: _logged_counts(logs[name])[1:] for name in ("on", "off")}  # [0]: the warm-up
            for k, step in enumerate(out):
                step.counts_match = all(len(c) > k and c[k] == step.prompt_tokens for c in logged.values())
            return out
        finally:
            stop(procs)


def _kind(s: Step) -> str:
    return "first" if s.first else f"extends by ~{round(s.added_tokens, -3) // 1000:.0f}k"


def report(steps: list[Step]) -> str:
    lines = ["| prompt tokens | steps | step | gateway CPU ms, cache on | cache off | added p50 ms, cache on | "
             "cache off | counts exact |", "|---|---|---|---|---|---|---|---|"]
    kinds = sorted({_kind(s) for s in steps}, key=lambda k: (k != "first", k))
    for lo, hi in BUCKETS:
        for kind in kinds:
            rows = [s for s in steps if lo <= s.prompt_tokens < hi and _kind(s) == kind]
            if not rows:
                continue
            med = statistics.median
            label = f"{lo // 1000}k-{hi // 1000}k" if hi < 10**9 else f"{lo // 1000}k+"
            lines.append(f"| {label} | {len(rows)} | {kind} | "
                         f"{med(r.cpu_ms_cached for r in rows):.1f} | {med(r.cpu_ms_uncached for r in rows):.1f} | "
                         f"{med(r.added_ms_cached for r in rows):.1f} | {med(r.added_ms_uncached for r in rows):.1f} | "
                         f"{sum(r.counts_match for r in rows)}/{len(rows)} |")
    return "\n".join(lines)


def tokenizer_floor(tokens: int = 10_000, seed: int = 0) -> float:
    """CPU ms the bundled tokenizer alone takes, in this process, for about `tokens` new tokens
    of the sessions' text (best of 10): what a step adding that much costs at the least, whatever
    the gateway caches. Each try is new text, as a step's is: the same text again comes out
    faster, its words held in the BPE model's own cache (interleaved in one process, best of 12:
    7.3 against 9.1 ms per 10k tokens)."""
    tok = PromptTokenizer(segment_cache=False)
    rng = random.Random(seed)
    best = float("inf")
    for _ in range(10):
        text = _text(rng, tokens * 3 // 8)  # (the sessions' text: about 2.7 tokens a word)
        t0 = time.process_time()
        n = len(tok.encode(text))
        best = min(best, (time.process_time() - t0) * 1e3 * tokens / n)
    return best


def real_increments(above: int = 100_000) -> list[int]:
    """What each step of the bundled WEKA Claude Code sessions adds to the step before, in
    tokens, where its prompt is over `above`: the sizes this benchmark's steps stand for."""
    from bouncer.sim.scenarios import TRACES
    from bouncer.sim.traces import load_weka

    out = []
    for session in load_weka(TRACES / "weka-claude-code" / "traces"):
        for prev, step in zip(session.steps, session.steps[1:], strict=False):
            if step.prompt_len > above and step.prompt_len > prev.prompt_len:
                out.append(step.prompt_len - prev.prompt_len)
    return sorted(out)


def main(n_sessions: int, steps: int, out: str | None) -> None:
    result = run(n_sessions, steps)
    print(report(result))
    floor = tokenizer_floor()
    print(f"the bundled tokenizer alone, in this process: {floor:.1f} ms of CPU for 10k new tokens")
    adds = real_increments()
    real = {"steps": len(adds), "p50": adds[len(adds) // 2], "p90": adds[int(len(adds) * 0.9)]} if adds else None
    if real:
        print(f"in the bundled WEKA sessions, a step over 100k tokens adds {real['p50']:,} tokens at the median, "
              f"{real['p90']:,} at p90 ({real['steps']} steps)")
    mismatched = sum(not s.counts_match for s in result)
    print(f"{len(result)} steps of {n_sessions} sessions, {min(s.prompt_tokens for s in result):,} to "
          f"{max(s.prompt_tokens for s in result):,} prompt tokens; token counts differing from a full "
          f"tokenization: {mismatched}")
    if out:
        pathlib.Path(out).write_text(json.dumps({"tokenizer_ms_per_10k": floor, "weka_steps_over_100k_added": real,
                                                 "steps": [asdict(s) for s in result]}, indent=2))
        print(f"saved {out}")
