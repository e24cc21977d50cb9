#!/usr/bin/env bash
# Regenerate docs/bench/prefix-admission: the admission policies on the `prefix` scenario (the
# Mooncake conversation trace, 8 replicas, 300 s), each with its own router, at loads 0.5 to 3;
# then docs/bench/prefix-admission-report. About 5 minutes here (two runs at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/prefix-admission
mkdir -p "$out"
run() {  # policy load
  .venv/bin/bouncer bench run --scenario prefix --policy "$1" --load "$2" --replicas 8 --duration 300 \
    --out "$out/prefix-$1-$2.json" > /dev/null
}
for load in 0.5 1 1.5 2 3; do
  run none "$load" & run tgi-cap "$load"; wait
  run vllm-queue-cap "$load" & run llmd-flow-control "$load"; wait
  run dynamo-busy "$load" & run bouncer "$load"; wait
done
.venv/bin/bouncer bench report "$out" --out docs/bench/prefix-admission-report
