#!/usr/bin/env bash
# Regenerate docs/bench/agents (issue #6): agent sessions closed-loop, concurrency swept from a few
# agents to far more than the KV pool holds. About 6 minutes on this project's 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/agents
mkdir -p "$out"
run() {  # policy sessions
  .venv/bin/bouncer bench run --scenario agents --policy "$1" --sessions "$2" --replicas 2 --duration 7200 \
    --out "$out/agents-$1-$2.json"
}
for n in 8 32 128; do
  run none "$n" & run request-cap "$n"; wait
  run bouncer "$n"
done
