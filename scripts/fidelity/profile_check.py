"""The engine model's derived step times against step times measured on a GPU
(`gpu_step_times.py`'s output): per measured step, the time the profile predicts over the time
measured, and the least-squares fit beside the profile's coefficients (fitted to the prefill and
decode steps; the mixed steps show whether the terms add up).

    .venv/bin/python scripts/fidelity/profile_check.py scripts/fidelity/results/h200-step-times.json
"""

from __future__ import annotations

import argparse
import json

from bouncer.sim.profiles import PROFILES

PROFILE = {"llama-3.1-8b": "llama-3.1-8b-h200", "qwen3-32b": "qwen3-32b-h200"}  # measured shapes -> profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results")
    args = ap.parse_args()
    result = json.load(open(args.results))
    print(f"{result['gpu']}, torch {result['torch']}")
    for m in result["models"]:
        prof = PROFILES[PROFILE[m["model"]]]
        f = m["fit"]
        print(f"\n{m['model']} ({prof.name}): coefficients derived / fitted to the prefill and decode steps")
        print(f"  a {prof.a * 1e3:.2f} / {f['a'] * 1e3:.2f} ms, b {prof.b:.3e} / {f['b']:.3e} s per token, "
              f"c {prof.c:.3e} / {f['c']:.3e} s per context token, d {prof.d:.3e} / {f['d']:.3e} s per pair")
        print("| step | measured ms | derived ms | derived / measured | fitted / measured |")
        print("|---|---:|---:|---:|---:|")
        ratios = []
        for p in m["points"]:
            decode = f"{p.get('sequences')} x {p.get('context_each')}"
            what = {"prefill": f"prefill {p.get('tokens')}", "decode": f"decode {decode}",
                    "mixed": f"{p.get('tokens')} prefill + {decode} decode"}[p["kind"]]
            pred = prof.step_time(p["batched"], p["context"], p["pairs"])
            ratios.append(pred / p["seconds"])
            fitted = f["a"] + f["b"] * p["batched"] + f["c"] * p["context"] + f["d"] * p["pairs"]
            print(f"| {what} | {p['seconds'] * 1e3:.2f} | {pred * 1e3:.2f} | {ratios[-1]:.2f} | "
                  f"{fitted / p['seconds']:.2f} |")
        print(f"derived / measured: {min(ratios):.2f} to {max(ratios):.2f}")


if __name__ == "__main__":
    main()
