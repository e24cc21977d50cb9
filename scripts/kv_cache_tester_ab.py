"""WEKA's kv-cache-tester through Bouncer, with the agent window and without it: the same Claude
Code sessions (data/traces/weka-claude-code/subagents, subagents included), the same seed, two
`bouncer engine` processes (Qwen3-32B on an H200, modelled) behind a `bouncer serve` process, one
run each, in real time, closed loop (`--recycle`: a session that ends is replaced by another).
Prints and saves, per run: the sessions completed, the steps the tester sent and those served,
TTFT of those served, the steps served past the TTFT SLO, Bouncer's decisions per reason (every
attempt, the openai SDK's retries included), and the engines' prefix-cache hits beside what the
sessions themselves reuse.

    python scripts/kv_cache_tester_ab.py [--users 15] [--duration 600] [--time-scale 0.05]
        [--out docs/bench/kv-cache-tester/ab-600s.json] [--logs DIR] [--only VARIANT]

Needs `.venv-kv-tester` (`make .venv-kv-tester/.installed`, or BOUNCER_KV_TESTER_PYTHON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from collections import Counter

import yaml
from prometheus_client.parser import text_string_to_metric_families

from bouncer.bench import kv_cache_tester
from bouncer.bench.loopback import free_port, wait_ok
from bouncer.config import key_digest
from bouncer.tokenizer import default_tokenizer_path

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTER = ROOT / "third_party/kv-cache-tester/trace_replay_tester.py"
PYTHON = pathlib.Path(os.environ.get("BOUNCER_KV_TESTER_PYTHON", ROOT / ".venv-kv-tester/bin/python"))
SESSIONS = ROOT / "data/traces/weka-claude-code/subagents"
MODEL = "qwen3-32b"
TTFT_SLO_S = 10.0
VARIANTS = {  # policy.agents of each run
    "agent window": {"subagent_separator": ":"},  # kv-cache-tester names subagents PARENT:AGENT
    "no agent window": {"enabled": False},
}


def gateway_config(port: int, engine_urls: list[str], agents: dict) -> dict:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "tenants": [{"name": "agents", "api_keys_sha256": [key_digest("EMPTY")],  # the tester's key
                     "slo": {"ttft_s": TTFT_SLO_S}, "queue_ttl_s": 30}],
        "models": [{"name": MODEL, "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                    "max_model_len": 131072,
                    "backends": [{"url": url, "name": f"r{i}"} for i, url in enumerate(engine_urls)]}],
        "policy": {"telemetry": {"scrape_interval_s": 0.25, "staleness_s": 2.0}, "agents": agents},
    }


def one_run(name: str, agents: dict, args, work: pathlib.Path) -> dict:
    engine_urls, port = [f"http://127.0.0.1:{free_port()}" for _ in range(2)], free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "bouncer", "engine", "--port", url.rsplit(":", 1)[1],
                               "--model", MODEL, "--profile", "qwen3-32b-h200", "--max-model-len", "131072"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for url in engine_urls]
    slug = name.replace(" ", "-")
    config = work / f"{slug}.yaml"
    config.write_text(yaml.safe_dump(gateway_config(port, engine_urls, agents)))
    try:
        for url in engine_urls:
            wait_ok(url + "/health")
        # the gateway's log goes to its own copy of the file: ours closes once it has started
        with open(args.logs / f"{slug}.jsonl", "w") if args.logs else contextlib.nullcontext(subprocess.DEVNULL) as log:
            procs.append(subprocess.Popen([sys.executable, "-m", "bouncer", "serve", "--config", str(config),
                                           "--log-level", "info" if args.logs else "warning", "--log-format", "json"],
                                          stdout=subprocess.DEVNULL, stderr=log))
        base = f"http://127.0.0.1:{port}"
        wait_ok(base + "/health")
        run = kv_cache_tester.run(PYTHON, TESTER, base, SESSIONS, work / slug, users=args.users,
                                  seconds=args.duration, time_scale=args.time_scale, seed=args.seed, max_ttft_s=60,
                                  recycle=True)
        with urllib.request.urlopen(base + "/metrics", timeout=10) as resp:
            families = list(text_string_to_metric_families(resp.read().decode()))
        decisions = Counter()
        for family in families:
            if family.name == "bouncer_decisions":
                for s in family.samples:
                    decisions[f"{s.labels['outcome']} {s.labels['reason']}"] += int(s.value)
        hits, queries = kv_cache_tester.prefix_hits(engine_urls)
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    ttfts = sorted(float(r["ttft"]) for r in run.served)
    peak = re.search(r"Peak Concurrent Users: (\d+)", run.log)
    return {
        "variant": name, "policy_agents": agents,
        "sessions_started": run.lifecycle["started"], "sessions_completed": run.lifecycle["completed"],
        "sessions_truncated": run.lifecycle["truncated"],  # past the tester's --max-context (128k)
        "subagents_completed": run.lifecycle["completed-subagent"],
        "steps_sent": len(run.rows), "steps_served": len(run.served),
        "served_past_ttft_slo": sum(t > TTFT_SLO_S for t in ttfts),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else None,
        "ttft_max_s": ttfts[-1] if ttfts else None,
        "failed_as_seen": dict(sorted(Counter(re.findall(r"Request failed: Error code: (\d+)", run.log)).items())),
        "decisions": dict(sorted(decisions.items())),
        "engine_prefix_hit_rate": hits / queries if queries else None,
        "sessions_own_reuse": kv_cache_tester.sessions_reuse(run),
        "peak_concurrent_users": int(peak.group(1)) if peak else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=15)
    ap.add_argument("--duration", type=int, default=600)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs/bench/kv-cache-tester/ab-600s.json")
    ap.add_argument("--logs", type=pathlib.Path, help="keep each gateway's log here (JSON lines, access lines "
                    "included: every decision with its session)")
    ap.add_argument("--only", choices=list(VARIANTS), help="run one variant")
    args = ap.parse_args()
    if not PYTHON.exists():
        sys.exit(f"no kv-cache-tester venv at {PYTHON}: make .venv-kv-tester/.installed")
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kv-cache-tester-") as tmp:
        runs = [one_run(name, agents, args, pathlib.Path(tmp)) for name, agents in VARIANTS.items()
                if args.only in (None, name)]
    for r in runs:
        print(f"{r['variant']}: {r['sessions_completed']} of {r['sessions_started']} sessions completed "
              f"({r['sessions_truncated']} cut at the tester's context limit; {r['subagents_completed']} subagents), "
              f"{r['steps_served']} of {r['steps_sent']} steps served, "
              f"{r['served_past_ttft_slo']} past the {TTFT_SLO_S:g} s TTFT SLO; TTFT p50 {r['ttft_p50_s']:.2f} s, "
              f"p95 {r['ttft_p95_s']:.2f} s, max {r['ttft_max_s']:.2f} s; failures seen {r['failed_as_seen']}; "
              f"engine prefix hits {r['engine_prefix_hit_rate']:.1%} "
              f"(the sessions reuse {r['sessions_own_reuse']:.1%})")
        print(f"  decisions: {r['decisions']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"users": args.users, "duration_s": args.duration, "time_scale": args.time_scale,
                                    "seed": args.seed, "ttft_slo_s": TTFT_SLO_S, "runs": runs}, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
