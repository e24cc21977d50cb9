"""Retry-After against what happened, from saved `bouncer bench run` results: per run and refusal
reason with more than 100 refusals, the median of Retry-After over the time until a request of
that tenant sent after the refusal got in (`retry_after_accuracy` in the result; the target is
0.5-2x), as a Markdown table.

    python scripts/retry_after_table.py docs/bench/goodput/*-bouncer-[23].json ...
"""

from __future__ import annotations

import json
import pathlib
import sys

MIN_REFUSALS = 100
LOW, HIGH = 0.5, 2.0


def main(paths: list[str]) -> int:
    print("| run | reason | refusals | median Retry-After / actual | within 0.5-2x |")
    print("|---|---|---:|---:|---|")
    misses = 0
    for path in paths:
        result = json.loads(pathlib.Path(path).read_text())
        name = pathlib.Path(path).stem
        for reason, acc in sorted(result["retry_after_accuracy"].items()):
            if acc["refusals"] <= MIN_REFUSALS or acc["median_ratio"] is None:
                continue
            ratio = acc["median_ratio"]
            ok = LOW <= ratio <= HIGH
            misses += not ok
            verdict = "yes" if ok else "**no**"
            print(f"| {name} | `{reason.split('/')[-1]}` | {acc['refusals']:,} | {ratio:.2f} | {verdict} |")
    print(f"\n{misses} outside 0.5-2x", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
