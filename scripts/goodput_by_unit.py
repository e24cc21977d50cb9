"""Issue 51's goodput targets for banded pools, from saved `bouncer bench run` results: per run
folder and load, each policy's goodput within SLO in requests, output tokens and prompt tokens a
second, and Bouncer's against the best peer's in each (targets: output tokens at least 1x, prompt
tokens at least 0.95x; requests reported beside them), as a Markdown table.

    python scripts/goodput_by_unit.py docs/bench/servegen-m-large --loads 2 3
"""

from __future__ import annotations

import argparse
import json
import pathlib

UNITS = (("requests/s", "goodput_rps"), ("output tokens/s", "goodput_tokens_per_s"),
         ("prompt tokens/s", "goodput_prompt_tokens_per_s"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("folders", nargs="+")
    ap.add_argument("--loads", nargs="+", type=float, default=[2.0, 3.0])
    args = ap.parse_args()
    print("| runs | load | unit | Bouncer | best peer | Bouncer / best peer |")
    print("|---|---|---|---:|---|---:|")
    for folder in args.folders:
        runs = [json.loads(f.read_text()) for f in sorted(pathlib.Path(folder).glob("*.json"))]
        runs = [r for r in runs if "goodput_rps" in r and not r.get("only_tenants")]
        for load in args.loads:
            at = {r["policy"]: r for r in runs if r["load"] == load}
            if "bouncer" not in at:
                continue
            for unit, key in UNITS:
                peers = {p: r[key] for p, r in at.items() if p != "bouncer" and key in r}
                if not peers or key not in at["bouncer"]:  # (saved before the field was)
                    print(f"| {pathlib.Path(folder).name} | {load:g} | {unit} | not in the saved runs | | |")
                    continue
                best = max(peers, key=peers.__getitem__)
                mine = at["bouncer"][key]
                print(f"| {pathlib.Path(folder).name} | {load:g} | {unit} | {mine:,.1f} | {best} {peers[best]:,.1f} | "
                      f"{mine / peers[best]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
