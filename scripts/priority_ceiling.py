"""The most requests, and output tokens, a policy that serves higher bands first can complete
within SLO, on a benchmark's own arrivals: an upper bound from the engine model, to set against
the goodput the policies measured (issue #18: on ServeGen's m-mid pool, does any policy that
keeps the light band's priority beat the queue cap counted in requests? Issue 51: in output
tokens?).

Each request costs its replica engine time whatever the schedule (`bouncer.sim.profiles`):
`b` per prompt token and per decode step, `d` per attention pair of its prompt, and `c` per
context token read at each of its decode steps (its prompt and, on average, half its answer). What the schedule
decides is the fixed cost `a` per step. Two ceilings are given. In the first, steps last the TPOT
SLO: a request within its TPOT SLO decodes at steps of about that length, and under load
something always decodes, so about `a / TPOT SLO` of every engine second goes to fixed costs.
(It is not strict: a step may run longer while its decoders' mean stays within the SLO.) The
second is the loosest: every step as long as the engine's token budget allows,
`a / step(max_num_batched_tokens)` of every second.

The bound is for a steady overload: over a window of arrivals in the middle of the run (by
default from 10 s to 50 s of a 60-s run), the engine time of that window against the cost of the
requests arriving in it. (Over a whole run the engines also work past the last arrival, on what
was admitted before it, which a bound on arrivals cannot hold.) The policies are simulated on the
same arrivals, and their goodput is counted over the same window.

The bands are filled from the top: each band whole if the engine time left allows, else as many of
its requests as fit, at the band's mean cost (an order blind to length, as arrival order and
earliest deadline are; one that refuses long prompts as late more often than short ones serves a
slightly cheaper mix), cheapest first (an oracle's shortest-job-first, the most requests any
order can fit), shortest prompt first (the one length a gateway knows before the answer), or
most output tokens per engine second first (an oracle that knows each answer's length, the most
output tokens any order can fit). Timing within the window is ignored (every request is assumed to fit around the
others), which can only raise the bound, and prefix caching is not counted, so it is a bound only
for traces without reuse (m-mid has none: prefix hit rate 0.0 in every saved run).

    python scripts/priority_ceiling.py [--trace data/traces/servegen/m-mid] [--loads 1,2,3]
        [--policies vllm-queue-cap,tgi-cap,bouncer] [--window 10,50] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

from bouncer.bench.goodput import DEFAULT_PROFILE, engine_profile, fleet_capacity, simulate, within_slo
from bouncer.sim.scenarios import TRACES, get_scenario
from bouncer.sim.workloads import make_requests

ORDERS = ("mean_order", "cheapest_first", "shortest_prompt", "most_output")


def request_cost(profile, prompt: int, output: int) -> float:
    """Engine seconds a request takes beyond the steps' fixed cost: its prompt's tokens and
    attention pairs (the step that computes the prompt's last token gives the first answer token),
    then one token at each of `output - 1` decode steps, the k-th reading prompt + k tokens of
    context."""
    decode_steps = max(0, output - 1)
    return (profile.b * (prompt + decode_steps) + profile.d * prompt * (prompt + 1) / 2
            + profile.c * decode_steps * (prompt + output / 2))


def ceiling(costs_by_band: dict[int, list[tuple[float, int, int]]], engine_s: float) -> dict:
    """Requests served, and their output tokens, when the bands take engine time from the top
    down; each request is (its cost, its output tokens, its prompt tokens). The band that does
    not fit whole gets the time left: at its mean cost (`mean_order`: any order blind to
    length), cheapest first (`cheapest_first`: the most requests, an oracle), shortest prompt
    first (`shortest_prompt`: the one length a gateway knows before the answer), or most output
    tokens per engine second first (`most_output`: an oracle that knows every answer's length,
    the most output tokens any order fits, to a request)."""
    left = engine_s
    out: dict = {"bands": {}}
    for band in sorted(costs_by_band, reverse=True):
        reqs = costs_by_band[band]
        whole = sum(r[0] for r in reqs)
        tokens = sum(r[1] for r in reqs)
        if whole <= left:
            served = {k: len(reqs) for k in ORDERS}
            served_tokens = {k: tokens for k in ORDERS}
            left -= whole
        else:
            share = left / whole
            served = {"mean_order": int(share * len(reqs))}
            served_tokens = {"mean_order": int(share * tokens)}
            for order, key in (("cheapest_first", lambda r: r[0]), ("shortest_prompt", lambda r: r[2]),
                               ("most_output", lambda r: -r[1] / r[0])):
                fit = fit_tokens = 0
                spent = 0.0
                for c, o, _ in sorted(reqs, key=key):
                    if spent + c > left:
                        break
                    spent, fit, fit_tokens = spent + c, fit + 1, fit_tokens + o
                served[order], served_tokens[order] = fit, fit_tokens
            left = 0.0
        out["bands"][band] = {"offered": len(reqs), **served,
                              "output_tokens": {"offered": tokens, **served_tokens}}
    for key in ORDERS:
        out[key] = sum(b[key] for b in out["bands"].values())
        out.setdefault("output_tokens", {})[key] = sum(b["output_tokens"][key] for b in out["bands"].values())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="surge")
    ap.add_argument("--trace", default=str(TRACES / "servegen" / "m-mid"))
    ap.add_argument("--loads", default="1,2,3")
    ap.add_argument("--policies", default="vllm-queue-cap,tgi-cap,bouncer")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--window", default="10,50", help="arrivals counted, seconds into the run: FROM,TO")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--out", help="save the table as JSON here")
    args = ap.parse_args()
    t0, t1 = (float(x) for x in args.window.split(","))
    if not 0 <= t0 < t1 <= args.duration:
        ap.error(f"--window {args.window}: want 0 <= FROM < TO <= --duration ({args.duration:g})")
    span = t1 - t0
    profile = engine_profile(args.profile)
    scenario = get_scenario(args.scenario, args.duration)
    traces = scenario.load(args.trace, None, "banded")
    capacity = fleet_capacity(scenario, traces, args.replicas, profile, args.seed, args.trace)
    tpot_slo = min(t.tpot_slo for t in scenario.tenants if t.tpot_slo)
    # the share of an engine second left once the steps' fixed costs are paid
    usable = {"tpot": 1 - profile.a / tpot_slo,
              "budget": 1 - profile.a / profile.step_time(profile.max_num_batched_tokens, 0)}
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        requests = make_requests(scenario.tenants, traces, load * capacity, args.duration, args.seed)
        costs: dict[int, list[tuple[float, int, int]]] = {}
        for r in requests:
            if t0 <= r.arrival < t1:
                costs.setdefault(r.priority, []).append((request_cost(profile, r.prompt_len, r.output_len),
                                                         r.output_len, r.prompt_len))
        row = {"load": load, "offered_rps": sum(map(len, costs.values())) / span, "ceiling_rps": {}, "measured_rps": {},
               "ceiling_output_tokens_per_s": {}, "measured_output_tokens_per_s": {}}
        for steps, share in usable.items():
            c = ceiling(costs, args.replicas * span * share)
            row["ceiling_rps"][steps] = {"mean_order": c["mean_order"] / span,
                                         "cheapest_first": c["cheapest_first"] / span, "bands": c["bands"]}
            row["ceiling_output_tokens_per_s"][steps] = {k: v / span for k, v in c["output_tokens"].items()}
        for policy in args.policies.split(","):
            _, _, done, _ = simulate(args.scenario, policy, load, args.seed, args.replicas, args.duration, args.trace,
                                     profile)
            good = [r for r in done if t0 <= r.arrival < t1 and within_slo(r)]
            row["measured_rps"][policy] = len(good) / span
            row["measured_output_tokens_per_s"][policy] = sum(r.output_len for r in good) / span
        rows.append(row)
    trace = os.path.relpath(args.trace)
    print(f"{args.scenario} on {trace}, {args.replicas} replicas, arrivals {t0:g}-{t1:g} s of {args.duration:g}, "
          f"capacity {capacity:.1f} req/s. Goodput in req/s, and the most that serving the bands from the top allows:")
    print("| load | offered | ceiling, steps within the TPOT SLO: mean order / cheapest first | the same, steps at the "
          "token budget | " + " | ".join(args.policies.split(",")) + " |")
    print("|---|---|---|---|" + "---|" * len(args.policies.split(",")))
    for row in rows:
        c = row["ceiling_rps"]
        tpot, budget = c["tpot"], c["budget"]
        print(f"| {row['load']:g} | {row['offered_rps']:.1f} | "
              f"{tpot['mean_order']:.1f} / {tpot['cheapest_first']:.1f} | "
              f"{budget['mean_order']:.1f} / {budget['cheapest_first']:.1f} | "
              + " | ".join(f"{g:.1f}" for g in row["measured_rps"].values()) + " |")
    print("\nThe same in output tokens/s within SLO; the ceilings: mean order / cheapest first / shortest prompt first "
          "/ most output tokens first (an oracle that knows each answer's length), steps within the TPOT SLO:")
    print("| load | offered | ceiling | " + " | ".join(args.policies.split(",")) + " |")
    print("|---|---|---|" + "---|" * len(args.policies.split(",")))
    for row in rows:
        c = row["ceiling_output_tokens_per_s"]["tpot"]
        offered = sum(b["output_tokens"]["offered"] for b in row["ceiling_rps"]["tpot"]["bands"].values()) / span
        print(f"| {row['load']:g} | {offered:,.0f} | {c['mean_order']:,.0f} / {c['cheapest_first']:,.0f} / "
              f"{c['shortest_prompt']:,.0f} / {c['most_output']:,.0f} | "
              + " | ".join(f"{g:,.0f}" for g in row["measured_output_tokens_per_s"].values()) + " |")
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {"scenario": args.scenario, "trace": trace, "replicas": args.replicas, "duration_s": args.duration,
             "window_s": [t0, t1], "seed": args.seed, "profile": profile.name, "capacity_rps": capacity,
             "usable_engine_share": usable, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
