"""Issue #18's speed target on the high-rate pool: Bouncer's run takes at most 2x the slowest
baseline's wall time. Runs `bouncer bench run` on ServeGen's m-mid (surge, 4 replicas) for
Bouncer and a baseline, alternating so that neither always runs first on this noisy machine,
and prints and saves each run's whole wall time, its simulation alone (`wall_seconds` in the
result, after the arrivals are drawn) and its peak memory, with the ratios per round.

    python scripts/servegen_wall_ratio.py [--load 3] [--duration 60] [--rounds 2]
        [--baseline llmd-flow-control] [--trace data/traces/servegen/m-mid]
        [--out docs/bench/servegen-m-mid/wall-ratio.json]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRACE = ROOT / "data/traces/servegen/m-mid"


def one_run(policy: str, load: float, duration: float, work: pathlib.Path, trace: pathlib.Path = TRACE) -> dict:
    out = work / f"{policy}.json"
    cmd = [sys.executable, "-m", "bouncer", "bench", "run", "--scenario", "surge", "--trace", str(trace),
           "--policy", policy, "--load", str(load), "--duration", str(duration), "--replicas", "4",
           "--out", str(out)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    whole = time.monotonic() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({os.waitstatus_to_exitcode(status)})")
    result = json.loads(out.read_text())
    return {"policy": policy, "whole_s": round(whole, 1), "simulation_s": round(result["wall_seconds"], 1),
            "peak_rss_mb": round(usage.ru_maxrss / 1024), "goodput_rps": result["goodput_rps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=float, default=3.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--baseline", default="llmd-flow-control", help="the slowest baseline in the m-mid table")
    ap.add_argument("--trace", default=str(TRACE), help="a ServeGen pool's folder (m-large: the validation pool)")
    ap.add_argument("--out", default=str(ROOT / "docs/bench/servegen-m-mid/wall-ratio.json"))
    args = ap.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = ["bouncer", args.baseline][::1 - 2 * (i % 2)]
            runs = {p: one_run(p, args.load, args.duration, pathlib.Path(tmp), pathlib.Path(args.trace)) for p in order}
            b, base = runs["bouncer"], runs[args.baseline]
            ratio = {"whole": round(b["whole_s"] / base["whole_s"], 2),
                     "simulation": round(b["simulation_s"] / base["simulation_s"], 2)}
            rounds.append({"order": order, "runs": runs, "ratio": ratio})
            print(f"round {i + 1} ({' then '.join(order)}): whole {b['whole_s']} s / {base['whole_s']} s = "
                  f"{ratio['whole']}x, simulation {b['simulation_s']} s / {base['simulation_s']} s = "
                  f"{ratio['simulation']}x; peak memory {b['peak_rss_mb']} / {base['peak_rss_mb']} MB", flush=True)
    saved = {"trace": args.trace, "load": args.load, "duration_s": args.duration, "baseline": args.baseline,
             "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rounds": rounds}
    pathlib.Path(args.out).write_text(json.dumps(saved, indent=1) + "\n")
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
