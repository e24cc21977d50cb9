#!/usr/bin/env bash
# Regenerate docs/bench/agents and its report (issue #6): agent sessions closed-loop, concurrency
# swept from a few agents to far more than the KV pool holds (about 8 contexts). About 45 minutes
# on this project's 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/agents
mkdir -p "$out"
run() {  # policy sessions [duration_s] [name suffix] [seed] [trace folder]
  .venv/bin/bouncer bench run --scenario agents --policy "$1" --sessions "$2" --replicas 2 --duration "${3:-7200}" \
    --seed "${5:-0}" ${6:+--trace "$6"} --out "$out/agents-$1-$2${4:-}.json"
}
for n in 8 32 128 256 512; do
  run none "$n" & run request-cap "$n"; wait
  run bouncer "$n"
done
# In two hours the agents that start together are still in their first sessions, and running all
# of them at once finishes the short ones first; longer runs approach the steady state (steps/h
# over the mean session length), the cap's slowly.
for n in 128 512; do
  run request-cap "$n" 28800 -8h & run bouncer "$n" 28800 -8h; wait
  run request-cap "$n" 86400 -24h & run bouncer "$n" 86400 -24h; wait
done
# Around 256 agents the cap's queue wait reaches the clients' timeout: there the outcome depends
# on the sessions drawn, so two seeds.
for seed in 0 1; do
  run request-cap 256 28800 "-8h-seed$seed" "$seed" & run bouncer 256 28800 "-8h-seed$seed" "$seed"; wait
done
run request-cap 512 28800 -8h-seed1 1 & run bouncer 512 28800 -8h-seed1 1; wait
# Sessions with subagents (data/traces/weka-claude-code/subagents): 15 sessions of 234 steps on
# average, their own and their subagents', so a session takes hours: 24-hour runs.
sub=data/traces/weka-claude-code/subagents
for n in 128 512; do
  run request-cap "$n" 86400 -24h-subagents 0 "$sub" & run bouncer "$n" 86400 -24h-subagents 0 "$sub"; wait
done
run none 512 7200 -subagents 0 "$sub" & run request-cap 512 7200 -subagents 0 "$sub"; wait
run bouncer 512 7200 -subagents 0 "$sub"
# What naming the parent is worth: the same sessions with subagents' steps sent without
# x-parent-session-id, so the window sees each subagent as an agent of its own (8 hours).
mkdir -p docs/bench/agents-subagent-ablation
for n in 128 512; do
  for named in 1 0; do
    .venv/bin/python - "$n" "$named" "$sub" <<'PY' &
import json, sys
from bouncer.bench import agents
n, named, trace = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
r = agents.run("bouncer", n, duration_s=8 * 3600, trace=trace, name_parents=named)
r["name_parents"] = named
out = f"docs/bench/agents-subagent-ablation/abl-{n}-8-{'named' if named else 'plain'}.json"
json.dump(r, open(out, "w"))
PY
  done
  wait
done
.venv/bin/bouncer bench report "$out" --out docs/bench/agents-report
