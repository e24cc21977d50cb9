#!/usr/bin/env bash
# The agents scenario through several gateways (simulator): one gateway, three independent, three
# sharing state 2 ms late; each agent's steps through its session's gateway. Results in
# docs/bench/agents-gateways (docs/benchmarks/several-gateways.md, "Several gateways"). About 15 minutes here.
set -euo pipefail
out=${1:-docs/bench/agents-gateways}
mkdir -p "$out"
for sessions in 128 256; do
  bouncer bench run --scenario agents --policy bouncer --sessions "$sessions" --duration 3600 \
    --out "$out/one-$sessions.json"
  bouncer bench run --scenario agents --policy bouncer --sessions "$sessions" --duration 3600 --gateways 3 \
    --out "$out/independent-$sessions.json"
  bouncer bench run --scenario agents --policy bouncer --sessions "$sessions" --duration 3600 --gateways 3 \
    --state-delay-ms 2 --out "$out/sharing-$sessions.json"
done
