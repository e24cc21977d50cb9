#!/usr/bin/env bash
# Regenerate docs/bench/agents and its report (issue #6): agent sessions closed-loop, concurrency
# swept from a few agents to far more than the KV pool holds. About 13 minutes on this project's
# 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/agents
mkdir -p "$out"
run() {  # policy sessions [duration_s] [name suffix]
  .venv/bin/bouncer bench run --scenario agents --policy "$1" --sessions "$2" --replicas 2 --duration "${3:-7200}" \
    --out "$out/agents-$1-$2${4:-}.json"
}
for n in 8 32 128; do
  run none "$n" & run request-cap "$n"; wait
  run bouncer "$n"
done
# In two hours the 128 agents that start together are still in their first sessions, and running
# all of them at once finishes the short ones first; longer runs approach the steady state
# (steps/h over the mean session length), the cap's slowly.
run request-cap 128 28800 -8h & run bouncer 128 28800 -8h; wait
run request-cap 128 86400 -24h & run bouncer 128 86400 -24h; wait
.venv/bin/bouncer bench report "$out" --out docs/bench/agents-report
