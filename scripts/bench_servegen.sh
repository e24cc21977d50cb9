#!/usr/bin/env bash
# Regenerate docs/bench/servegen: the surge scenario's SLOs with ServeGen client pools as the
# traffic (every client a tenant), every policy. DeepSeek-R1's pool on 2 replicas at loads 1, 2
# and 3 (about a minute here); the m-mid language-model pool, thousands of short requests a
# second, on 4 replicas at loads 0.5 to 3, 60 s each (issue #18; about 15 minutes here).
set -euo pipefail
cd "$(dirname "$0")/.."
traces=${BOUNCER_TRACES_DIR:-data/traces}/servegen
out=docs/bench/servegen
mkdir -p "$out"
for load in 1 2 3; do
  for pol in none tgi-cap vllm-queue-cap llmd-flow-control dynamo-busy bouncer; do
    .venv/bin/bouncer bench run --scenario surge --trace "$traces/deepseek-r1" --policy "$pol" --load "$load" \
      --duration 120 --replicas 2 --out "$out/surge-servegen-$pol-$load.json" > /dev/null
  done
done
.venv/bin/bouncer bench report "$out" --out docs/bench/servegen-report
out=docs/bench/servegen-m-mid
mkdir -p "$out"
for load in 0.5 1 2 3; do
  for pol in none tgi-cap vllm-queue-cap llmd-flow-control dynamo-busy bouncer; do
    .venv/bin/bouncer bench run --scenario surge --trace "$traces/m-mid" --policy "$pol" --load "$load" \
      --duration 60 --replicas 4 --out "$out/surge-m-mid-$pol-$load.json" > /dev/null
  done
done
.venv/bin/bouncer bench report "$out" --out docs/bench/servegen-m-mid-report
