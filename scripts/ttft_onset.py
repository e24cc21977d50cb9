"""When a band's first tokens come near its TTFT SLO: during the first seconds of an overload or
all through it. One simulated run (ServeGen's m-mid pool by default, `surge`'s SLOs, 4 replicas,
as in docs/benchmarks/servegen.md); for each band, the TTFT of its completed requests from their first
attempt, over all of them and over those that arrived after the first `--after` seconds.

A standing queue is judged at the end of a whole interval (`bouncer.core.flow.standing_queue`), so
the requests of the overload's first seconds are planned on their whole SLO; this tells that
onset apart from a band served at the edge all along.

    python scripts/ttft_onset.py [--load 3] [--policy bouncer] [--after 4] [--duration 60]
"""

from __future__ import annotations

import argparse

from bouncer.bench import goodput
from bouncer.sim.scenarios import TRACES


def _pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(len(xs) * q))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", type=float, default=3.0)
    ap.add_argument("--policy", default="bouncer")
    ap.add_argument("--after", type=float, default=4.0, help="seconds of arrivals left out of the second row")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--trace", default=str(TRACES / "servegen" / "m-mid"))
    args = ap.parse_args()
    _, _, requests, _ = goodput.simulate("surge", args.policy, args.load, 0, 4, args.duration, args.trace)
    print(f"{args.policy}, load {args.load:g}: TTFT of completed requests from their first attempt, seconds")
    print("| band | arrived | completed | p50 | p90 | p99 | over 0.9 SLO | of them, served on a retry | late |")
    print("|---|---|---|---|---|---|---|---|---|")
    for band in sorted({r.priority for r in requests}, reverse=True):
        done = [r for r in requests if r.priority == band and r.outcome == "completed" and r.first_token_at is not None]
        for label, since in (("all", float("-inf")), (f"after {args.after:g} s", args.after)):
            rows = [r for r in done if r.arrival >= since]
            if not rows:
                continue
            ttfts = sorted(r.first_token_at - r.arrival for r in rows)  # type: ignore[operator]
            slo = rows[0].ttft_slo or float("inf")
            # a retry keeps its first attempt's deadline, and goes first by it (earliest deadline)
            retried = sum(r.first_token_at - r.arrival > 0.9 * slo and r.attempt > 1 for r in rows)  # type: ignore[operator]
            print(f"| {band} | {label} | {len(rows)} | {_pct(ttfts, 0.5):.2f} | {_pct(ttfts, 0.9):.2f} | "
                  f"{_pct(ttfts, 0.99):.2f} | {sum(t > 0.9 * slo for t in ttfts)} | {retried} | "
                  f"{sum(t > slo for t in ttfts)} |")


if __name__ == "__main__":
    main()
