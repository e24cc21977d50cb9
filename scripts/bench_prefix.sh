#!/usr/bin/env bash
# Regenerate docs/bench/prefix (routers on the Mooncake conversation trace, issue #5) and
# docs/bench/prefix-report. About 4 minutes on this project's 2-core machine (two runs at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/prefix
mkdir -p "$out"
run() {  # admission router load [extra flags]
  .venv/bin/bouncer bench run --scenario prefix --policy "$1" --routing "$2" --load "$3" --replicas 8 \
    --duration 300 --out "$out/$1-$2${5:-}-$3.json" ${4:-} > /dev/null
}
for load in 0.8 1.2; do
  run none round-robin "$load" & run none least-loaded "$load"; wait
  run none sglang-cache-aware "$load" & run bouncer round-robin "$load"; wait
  run bouncer least-loaded "$load" & run bouncer sglang-cache-aware "$load"; wait
  run bouncer prefix-aware "$load" & run bouncer prefix-aware "$load" --kv-events -kv-events; wait
done
.venv/bin/bouncer bench report "$out" --out docs/bench/prefix-report
