#!/usr/bin/env bash
# Regenerate docs/bench/servegen: the surge scenario's SLOs with ServeGen's DeepSeek-R1 client pool
# as the traffic (every client a tenant), every policy, loads 1, 2 and 3. About a minute here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/servegen
trace=${BOUNCER_TRACES_DIR:-data/traces}/servegen/deepseek-r1
mkdir -p "$out"
for load in 1 2 3; do
  for pol in none tgi-cap vllm-queue-cap llmd-flow-control dynamo-busy bouncer; do
    .venv/bin/bouncer bench run --scenario surge --trace "$trace" --policy "$pol" --load "$load" --duration 120 \
      --replicas 2 --out "$out/surge-servegen-$pol-$load.json" > /dev/null
  done
done
.venv/bin/bouncer bench report "$out" --out docs/bench/servegen-report
