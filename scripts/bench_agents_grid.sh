#!/usr/bin/env bash
# Regenerate docs/bench/agents-grid (issue 51): the agent window against a request-level cap,
# 2 simulated hours, seed 1, at 32-512 agents on 2 and 4 replicas, on the shipped sessions and on
# each half of them (alternate files of data/traces/weka-claude-code/traces in name order: a
# split of traffic no policy was tuned on apart). 60 runs, about half an hour here. Longer runs:
# DURATION=28800 OUT=docs/bench/agents-grid/8h (8 simulated hours, about two hours here); a run
# whose file exists already is skipped (SKIP_DONE=1).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-docs/bench/agents-grid}
duration=${DURATION:-7200}
mkdir -p "$out"
halves=$(mktemp -d)
trap 'rm -rf "$halves"' EXIT
mkdir "$halves/half-a" "$halves/half-b"
i=0
for f in $(ls data/traces/weka-claude-code/traces | sort); do
  if (( i % 2 == 0 )); then cp "data/traces/weka-claude-code/traces/$f" "$halves/half-a/"; else
    cp "data/traces/weka-claude-code/traces/$f" "$halves/half-b/"; fi
  i=$((i + 1))
done
for set in grid half-a half-b; do
  trace=(); [[ $set != grid ]] && trace=(--trace "$halves/$set")
  for replicas in 2 4; do
    for agents in 32 64 128 256 512; do
      for pol in bouncer request-cap; do
        [[ ${SKIP_DONE:-0} == 1 && -e "$out/$set-$replicas-$agents-$pol.json" ]] && continue
        echo .venv/bin/bouncer bench run --scenario agents --policy "$pol" --replicas "$replicas" --sessions "$agents" \
          --duration "$duration" --seed 1 "${trace[@]}" --out "$out/$set-$replicas-$agents-$pol.json"
      done
    done
  done
done | xargs -P 2 -I{} sh -c "{} > /dev/null"
