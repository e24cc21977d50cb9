"""Gateway CPU per agent step on this tree against another revision, in one run: a gateway of
each tree (the chat-segment token cache on) in front of the same fast upstream, both pinned to
the same core, the same steps sent to each in alternating order (`bouncer bench long-prompts`'s
sessions: 3 of 13 steps adding ~10k tokens, then 5 adding ~1k). Prints the median CPU per step
for a session's first steps, the steps over ~60k tokens that add ~10k, and those that add ~1k.

    usage: .venv/bin/python scripts/long_prompts_ab.py [REV]   (default HEAD~1)
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from bouncer.bench.long_prompts import _config, _post, sessions
from bouncer.bench.loopback import cpu_seconds, free_port, pinned, stop, wait_ok

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main(rev: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        old = work / "old"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old), rev], check=True)
        try:
            run({rev: old / "src", "this tree": ROOT / "src"}, work)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)


def run(trees: dict[str, pathlib.Path], work: pathlib.Path) -> None:
    up = free_port()
    ports = {name: free_port() for name in trees}
    procs = [subprocess.Popen([*pinned(0), sys.executable, "-m", "bouncer.bench.fast_upstream", "--port", str(up)])]
    pids = {}
    try:
        for k, (name, src) in enumerate(trees.items()):
            cfg = work / f"gateway-{k}.yaml"
            cfg.write_text(json.dumps(_config(f"http://127.0.0.1:{up}", ports[name], 4_000_000, None)))
            proc = subprocess.Popen([*pinned(1), sys.executable, "-m", "bouncer", "serve", "--config", str(cfg)],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONPATH": str(src)})
            procs.append(proc)
            pids[name] = proc.pid
        for name in trees:
            wait_ok(f"http://127.0.0.1:{ports[name]}/ready")
        kinds = ("first steps", "over 60k, adding ~10k", "over 100k, adding ~1k")
        cpu: dict[str, dict[str, list[float]]] = {name: {kind: [] for kind in kinds} for name in trees}
        for session in sessions(3, 13):
            for i, messages in enumerate(session):
                body = json.dumps({"model": "fast", "max_tokens": 256, "messages": messages}).encode()
                kind = kinds[0] if i == 0 else kinds[1] if 8 <= i < 13 else kinds[2] if i >= 13 else None
                for name in (list(trees) if i % 2 else list(reversed(trees))):
                    before = cpu_seconds(pids[name])
                    _post(f"http://127.0.0.1:{ports[name]}/v1/chat/completions", body)
                    time.sleep(0.05)  # the access log line and the permit's release land after the answer
                    if kind is not None:
                        cpu[name][kind].append((cpu_seconds(pids[name]) - before) * 1e3)
    finally:
        stop(procs)
    print("gateway CPU per step, median ms: " + ", ".join(trees))
    for kind in kinds:
        print(f"  {kind:>22}: " + "  ".join(f"{statistics.median(cpu[name][kind]):6.2f}" for name in trees)
              + f"   ({len(cpu[next(iter(trees))][kind])} steps)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "HEAD~1")
