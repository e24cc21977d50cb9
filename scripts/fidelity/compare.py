"""Side by side: real vLLM (CPU) and Bouncer's engine model on the same request stream.

    .venv/bin/python scripts/fidelity/compare.py scripts/fidelity/results/vllm-cpu.json \\
        scripts/fidelity/results/vllm-cpu-run2.json scripts/fidelity/results/model-cpu-tiny.json \\
        --out docs/img/engine-fidelity.png

Prints one Markdown table row per run (makespan, TTFT and end-to-end percentiles, preemptions,
prefix-cache hits, peak waiting) plus the rank correlation of each run's completion order with
the first run's, and plots KV usage, running and waiting over time.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def kendall_tau(ranks: list[int]) -> float:
    """Rank correlation of `ranks` with 0..n-1 (no ties): 1 same order, -1 reversed."""
    n = len(ranks)
    concordant = sum(1 for i in range(n) for j in range(i + 1, n) if ranks[i] < ranks[j])
    pairs = n * (n - 1) // 2
    return (2 * concordant - pairs) / pairs


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def delta(run: dict, name: str) -> float:
    return (run["metrics_after"].get(name) or 0) - (run["metrics_before"].get(name) or 0)


def summary(run: dict) -> dict:
    reqs = [r for r in run["requests"] if r["status"] == 200]
    ttft = [r["first_token"] - r["send"] for r in reqs]
    e2e = [r["finish"] - r["send"] for r in reqs]
    waiting = [v for v in run["series"]["vllm:num_requests_waiting"] if v is not None]
    running = [v for v in run["series"]["vllm:num_requests_running"] if v is not None]
    return {"ok": len(reqs), "makespan": max(r["finish"] for r in reqs),
            "ttft_p50": pct(ttft, 0.5), "ttft_p90": pct(ttft, 0.9), "e2e_p50": pct(e2e, 0.5), "e2e_p90": pct(e2e, 0.9),
            "preemptions": delta(run, "vllm:num_preemptions_total"),
            "queries": delta(run, "vllm:prefix_cache_queries_total"),
            "hits": delta(run, "vllm:prefix_cache_hits_total"),
            "peak_running": max(running), "peak_waiting": max(waiting)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="replay.py outputs; the first is the reference")
    ap.add_argument("--labels", nargs="*", help="one per run (default: file names)")
    ap.add_argument("--out", help="PNG of KV usage / running / waiting over time")
    args = ap.parse_args()
    runs = [json.loads(pathlib.Path(p).read_text()) for p in args.runs]
    labels = args.labels or [pathlib.Path(p).stem for p in args.runs]
    ref_order = runs[0]["completion_order"]
    print("| run | ok | makespan s | TTFT p50 / p90 s | e2e p50 / p90 s | preemptions | prefix queries / hits "
          "| peak running / waiting | completion order vs first (Kendall tau) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, run in zip(labels, runs, strict=True):
        s = summary(run)
        order = run["completion_order"]
        tau = kendall_tau([ref_order.index(i) for i in order])
        print(f"| {label} | {s['ok']} | {s['makespan']:.1f} | {s['ttft_p50']:.3f} / {s['ttft_p90']:.2f} | "
              f"{s['e2e_p50']:.2f} / {s['e2e_p90']:.2f} | {s['preemptions']:.0f} | "
              f"{s['queries']:.0f} / {s['hits']:.0f} | {s['peak_running']:.0f} / {s['peak_waiting']:.0f} | "
              f"{tau:.3f} |")
    if args.out:
        fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        series = [("vllm:kv_cache_usage_perc", "KV cache usage"), ("vllm:num_requests_running", "running"),
                  ("vllm:num_requests_waiting", "waiting")]
        for ax, (name, title) in zip(axes, series, strict=True):
            for label, run in zip(labels, runs, strict=True):
                ax.plot(run["series"]["t"], run["series"][name], label=label, linewidth=1.2)
            ax.set_ylabel(title)
            ax.grid(alpha=0.3)
        axes[0].legend(loc="upper right")
        axes[-1].set_xlabel("seconds since the first request")
        fig.suptitle("Same 80-request stream: real vLLM 0.32 (CPU) vs Bouncer's engine model")
        fig.tight_layout()
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=110)
        print(f"saved {args.out}")


if __name__ == "__main__":
    main()
