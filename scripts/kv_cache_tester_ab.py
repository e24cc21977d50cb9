"""WEKA's kv-cache-tester through Bouncer, with the agent window and without it: the same Claude
Code sessions (data/traces/weka-claude-code/subagents, subagents included), the same seed, two
`bouncer engine` processes (Qwen3-32B on an H200, modelled) behind a `bouncer serve` process, one
run each, in real time, closed loop (`--recycle`: a session that ends is replaced by another).
Prints and saves, per run: the sessions completed, the steps the tester sent and those served,
TTFT of those served, the steps served past the TTFT SLO, Bouncer's decisions per reason (every
attempt, the openai SDK's retries included), and the engines' prefix-cache hits beside what the
sessions themselves reuse.

    python scripts/kv_cache_tester_ab.py [--users 15] [--duration 120] [--time-scale 0.05]
        [--out docs/bench/kv-cache-tester/ab.json]

Needs `.venv-kv-tester` (`make .venv-kv-tester/.installed`, or BOUNCER_KV_TESTER_PYTHON).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import urllib.request

import yaml
from prometheus_client.parser import text_string_to_metric_families

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


def tester_inputs(work: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    traces, tok = work / "traces", work / "tokenizer"
    traces.mkdir()
    tok.mkdir()
    for gz in sorted(SESSIONS.glob("*.json.gz")):
        (traces / gz.name.removesuffix(".gz")).write_bytes(gzip.decompress(gz.read_bytes()))
    (tok / "tokenizer.json").write_bytes(default_tokenizer_path().read_bytes())
    (tok / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return traces, tok


def gateway_config(port: int, engine_ports: list[int], agents: dict) -> dict:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "tenants": [{"name": "agents", "api_keys_sha256": [key_digest("EMPTY")],  # the tester's key
                     "slo": {"ttft_s": TTFT_SLO_S}, "queue_ttl_s": 30}],
        "models": [{"name": MODEL, "engine": "vllm", "tokenizer": str(default_tokenizer_path()),
                    "max_model_len": 131072,
                    "backends": [{"url": f"http://127.0.0.1:{p}", "name": f"r{i}"}
                                 for i, p in enumerate(engine_ports)]}],
        "policy": {"telemetry": {"scrape_interval_s": 0.25, "staleness_s": 2.0}, "agents": agents},
    }


def scrape(url: str) -> list:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        return list(text_string_to_metric_families(resp.read().decode()))


def one_run(name: str, agents: dict, args, traces: pathlib.Path, tok: pathlib.Path, work: pathlib.Path) -> dict:
    engine_ports, port = [free_port(), free_port()], free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "bouncer", "engine", "--port", str(p), "--model", MODEL,
                               "--profile", "qwen3-32b-h200", "--max-model-len", "131072"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in engine_ports]
    config = work / f"{name.replace(' ', '-')}.yaml"
    config.write_text(yaml.safe_dump(gateway_config(port, engine_ports, agents)))
    try:
        for p in engine_ports:
            wait_ok(f"http://127.0.0.1:{p}/health")
        procs.append(subprocess.Popen([sys.executable, "-m", "bouncer", "serve", "--config", str(config),
                                       "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        base = f"http://127.0.0.1:{port}"
        wait_ok(base + "/health")
        out = work / f"results-{name.replace(' ', '-')}"
        run = subprocess.run(
            [str(PYTHON), str(TESTER), "--api-endpoint", base, "--trace-directory", str(traces), "--output-dir",
             str(out), "--tokenizer", str(tok), "--start-users", str(args.users), "--max-users", str(args.users),
             "--max-ttft", "60", "--time-scale", str(args.time_scale), "--test-duration", str(args.duration),
             "--seed", str(args.seed), "--recycle", "--skip-graphs", "--no-color"],
            capture_output=True, text=True, timeout=args.duration + 600, cwd=TESTER.parent)
        log = run.stdout + run.stderr
        if run.returncode != 0:
            raise RuntimeError(f"kv-cache-tester failed ({run.returncode}):\n{log[-3000:]}")
        with open(out / "detailed_results.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        with open(out / "user_lifecycle.csv", newline="") as f:  # subagents are users named PARENT-SAn
            lifecycle = _counts([e["event_type"] + ("-subagent" if "-SA" in e["user_id"] else "")
                                 for e in csv.DictReader(f)])
        decisions: dict[str, int] = {}
        for family in scrape(base):
            if family.name == "bouncer_decisions":
                for s in family.samples:
                    key = f"{s.labels['outcome']} {s.labels['reason']}"
                    decisions[key] = decisions.get(key, 0) + int(s.value)
        hits = queries = 0.0
        for p in engine_ports:
            for family in scrape(f"http://127.0.0.1:{p}"):
                for s in family.samples:
                    hits += s.value if s.name == "vllm:prefix_cache_hits_total" else 0
                    queries += s.value if s.name == "vllm:prefix_cache_queries_total" else 0
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(10)
    ok = [r for r in rows if r["success"] == "True"]
    ttfts = sorted(float(r["ttft"]) for r in ok)
    reused = sum(int(r["cache_hit_blocks"]) for r in ok)
    blocks = reused + sum(int(r["cache_miss_blocks"]) for r in ok)
    return {
        "variant": name, "policy_agents": agents,
        "sessions_started": lifecycle.get("started", 0), "sessions_completed": lifecycle.get("completed", 0),
        "sessions_truncated": lifecycle.get("truncated", 0),  # past the tester's --max-context (128k)
        "subagents_completed": lifecycle.get("completed-subagent", 0),
        "steps_sent": len(rows), "steps_served": len(ok),
        "served_past_ttft_slo": sum(t > TTFT_SLO_S for t in ttfts),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else None,
        "ttft_max_s": ttfts[-1] if ttfts else None,
        "failed_as_seen": dict(sorted(_counts(re.findall(r"Request failed: Error code: (\d+)", log)).items())),
        "decisions": dict(sorted(decisions.items())),
        "engine_prefix_hit_rate": hits / queries if queries else None,
        "sessions_own_reuse": reused / blocks if blocks else None,
        "peak_concurrent_users": int(m.group(1)) if (m := re.search(r"Peak Concurrent Users: (\d+)", log)) else None,
    }


def _counts(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=15)
    ap.add_argument("--duration", type=int, default=120)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=2)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs/bench/kv-cache-tester/ab.json")
    args = ap.parse_args()
    if not PYTHON.exists():
        sys.exit(f"no kv-cache-tester venv at {PYTHON}: make .venv-kv-tester/.installed")
    with tempfile.TemporaryDirectory(prefix="kv-cache-tester-") as tmp:
        work = pathlib.Path(tmp)
        traces, tok = tester_inputs(work)
        runs = [one_run(name, agents, args, traces, tok, work) for name, agents in VARIANTS.items()]
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
