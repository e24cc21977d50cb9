#!/usr/bin/env bash
# Regenerate docs/bench/defaults: Bouncer without its two newest defaults, against the shipped runs
# (docs/bench/goodput, docs/bench/servegen) and the best baseline:
#   before:       retries.deadline=fresh (a retry is a new request) and tpot_reserve_fraction=0;
#   retries only: first-attempt deadlines, no TPOT reserve;
#   shipped:      both (a retry keeps its first attempt's TTFT deadline; lower bands leave room in
#                 the batch while a higher band sends).
# About 5 minutes here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/defaults
mkdir -p "$out"
trace=${BOUNCER_TRACES_DIR:-data/traces}/servegen/deepseek-r1
run() {  # name scenario load [extra args]
  local name=$1 sc=$2 load=$3
  shift 3
  local sets=(--set tpot_reserve_fraction=0)
  [ "$name" = before ] && sets+=(--set retries.deadline=fresh)
  .venv/bin/bouncer bench run --scenario "$sc" --policy bouncer --load "$load" --duration 120 --replicas 2 \
    "${sets[@]}" "$@" --out "$out/$name-$sc${suffix:-}-$load.json" > /dev/null
}
for name in before retries-only; do
  for sc in rogue-tenant consolidation surge fairness; do
    for load in 0.5 1 1.5 2 3; do run "$name" "$sc" "$load"; done
  done
  for load in 1 2 3; do suffix=-servegen run "$name" surge "$load" --trace "$trace"; done
done
.venv/bin/python - <<'PY'
import json
import pathlib

BASELINES = ("none", "tgi-cap", "vllm-queue-cap", "llmd-flow-control", "dynamo-busy")


def load(path):
    return json.loads(pathlib.Path(path).read_text())


def top(r):
    bands = {t["priority"] for t in r["tenants"].values()}
    if len(bands) < 2:
        return ""
    ts = [t for t in r["tenants"].values() if t["priority"] == max(bands)]
    return f" ({sum(t['slo_attainment'] * t['offered'] for t in ts) / sum(t['offered'] for t in ts):.1%})"


print("goodput req/s (top band's SLO attainment): before | retries only | shipped | best baseline")
rows = [(sc, ld, f"docs/bench/goodput/{sc}-{{}}-{ld}.json", f"docs/bench/defaults/{{}}-{sc}-{ld}.json")
        for sc in ("rogue-tenant", "consolidation", "surge", "fairness") for ld in ("0.5", "1", "1.5", "2", "3")]
rows += [("servegen", ld, f"docs/bench/servegen/surge-servegen-{{}}-{ld}.json",
          f"docs/bench/defaults/{{}}-surge-servegen-{ld}.json") for ld in ("1", "2", "3")]
for sc, ld, shipped, variant in rows:
    before, retries = load(variant.format("before")), load(variant.format("retries-only"))
    now = load(shipped.format("bouncer"))
    best = max((load(shipped.format(p)) for p in BASELINES), key=lambda r: r["goodput_rps"])
    cells = [f"{r['goodput_rps']:6.2f}{top(r)}" for r in (before, retries, now)]
    print(f"  {sc:>13} {ld:>3}: " + " | ".join(cells) + f" | {best['goodput_rps']:6.2f} {best['policy']}")
PY
