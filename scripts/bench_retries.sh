#!/usr/bin/env bash
# Regenerate docs/bench/retries: Bouncer with `retries.deadline: first-attempt` (a retry keeps its
# first attempt's TTFT deadline; once that has passed, the scenarios' tenants have it refused) on the main matrix's
# scenarios and on ServeGen's client pool, then print it beside the shipped runs
# (docs/bench/goodput, docs/bench/servegen) and the best baseline. About 2 minutes here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/retries
mkdir -p "$out"
for sc in rogue-tenant consolidation surge fairness; do
  for load in 0.5 1 1.5 2 3; do
    .venv/bin/bouncer bench run --scenario "$sc" --policy bouncer --load "$load" --duration 120 --replicas 2 \
      --set retries.deadline=first-attempt --out "$out/$sc-bouncer-$load.json" > /dev/null
  done
done
trace=${TRACES:-../shared/traces}/servegen/deepseek-r1
for load in 1 2 3; do
  .venv/bin/bouncer bench run --scenario surge --trace "$trace" --policy bouncer --load "$load" --duration 120 \
    --replicas 2 --set retries.deadline=first-attempt --out "$out/surge-servegen-bouncer-$load.json" > /dev/null
done
.venv/bin/python - <<'PY'
import json
import pathlib

BASELINES = ("none", "tgi-cap", "vllm-queue-cap", "llmd-flow-control", "dynamo-busy")


def load(path):
    return json.loads(pathlib.Path(path).read_text())


def top(r):
    band = max(t["priority"] for t in r["tenants"].values())
    ts = [t for t in r["tenants"].values() if t["priority"] == band]
    return sum(t["slo_attainment"] * t["offered"] for t in ts) / sum(t["offered"] for t in ts)


print("goodput req/s (top band's SLO attainment): fresh deadlines (shipped) | first-attempt deadlines | best baseline")
rows = [(sc, load_, f"docs/bench/goodput/{sc}-{{}}-{load_}.json", f"docs/bench/retries/{sc}-bouncer-{load_}.json")
        for sc in ("rogue-tenant", "consolidation", "surge", "fairness") for load_ in ("0.5", "1", "1.5", "2", "3")]
rows += [("servegen", load_, f"docs/bench/servegen/surge-servegen-{{}}-{load_}.json",
          f"docs/bench/retries/surge-servegen-bouncer-{load_}.json") for load_ in ("1", "2", "3")]
for sc, load_, shipped, on in rows:
    a, b = load(shipped.format("bouncer")), load(on)
    best = max((load(shipped.format(p)) for p in BASELINES), key=lambda r: r["goodput_rps"])
    print(f"  {sc:>13} {load_:>3}: {a['goodput_rps']:6.2f} ({top(a):.1%}) | {b['goodput_rps']:6.2f} ({top(b):.1%})"
          f" | {best['goodput_rps']:6.2f} {best['policy']}")
PY
