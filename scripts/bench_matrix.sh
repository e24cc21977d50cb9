#!/usr/bin/env bash
# Regenerate docs/bench/goodput (every scenario x policy x load) and docs/bench/report.
# About 5 minutes on this project's 2-core machine; runs are deterministic for a given seed.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/goodput
mkdir -p "$out"
for sc in rogue-tenant consolidation surge fairness flood; do
  for load in 0.5 1 1.5 2 3; do
    for pol in none tgi-cap vllm-queue-cap llmd-flow-control dynamo-busy bouncer; do
      .venv/bin/bouncer bench run --scenario "$sc" --policy "$pol" --load "$load" --duration 120 --replicas 2 \
        --out "$out/$sc-$pol-$load.json" > /dev/null
    done
  done
done
.venv/bin/bouncer bench report "$out" --out docs/bench/report
