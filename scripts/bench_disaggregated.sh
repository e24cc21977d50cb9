#!/usr/bin/env bash
# Regenerate docs/bench/disaggregated: the `disaggregated` scenario (issue #22), long-prompt RAG
# beside long-answer reasoning chat on separate prefill and decode pools, 8 engines of
# llama-3.1-8b-h100 split 5 prefill : 3 decode by the mix, every policy modelled on two pools, at
# loads 0.5 to 3, 120 s of arrivals each (about 5 minutes here).
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/disaggregated
mkdir -p "$out"
for load in 0.5 1 1.5 2 3; do
  for pol in none vllm-queue-cap dynamo-busy pd-current-load bouncer; do
    .venv/bin/bouncer bench run --scenario disaggregated --policy "$pol" --load "$load" \
      --duration 120 --replicas 8 --out "$out/disaggregated-$pol-$load.json" > /dev/null
  done
done
.venv/bin/bouncer bench report "$out" --out docs/bench/disaggregated-report
