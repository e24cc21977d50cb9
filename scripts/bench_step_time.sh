#!/usr/bin/env bash
# What Bouncer's knowledge of the engines' step time is worth, in the fleet simulator: each
# scenario and load with the step time given (the profile's coefficients in the config), learned
# online from the requests (bouncer/core/learning/step_time_learner.py; only the engine's token budget
# stated) and off (no latency prediction). Results in docs/bench/step-time, a table on stdout.
# About 2 minutes on this project's 2-core machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/step-time
mkdir -p "$out"
for sc in surge consolidation rogue-tenant; do
  for load in 2 3; do
    for st in given learned off; do
      .venv/bin/bouncer bench run --scenario "$sc" --policy bouncer --load "$load" --duration 120 --replicas 2 \
        --step-time "$st" --out "$out/$sc-$load-$st.json" > /dev/null
    done
  done
done
.venv/bin/python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print(f"{'scenario':>14} {'load':>4}  {'given':>7} {'learned':>8} {'off':>7}  learned/given  top band given / learned / off")
for sc in ("surge", "consolidation", "rogue-tenant"):
    for load in ("2", "3"):
        r = {st: json.loads((out / f"{sc}-{load}-{st}.json").read_text()) for st in ("given", "learned", "off")}
        top = max(r["given"]["tenants"].values(), key=lambda t: t["priority"])
        name = next(n for n, t in r["given"]["tenants"].items() if t is top)
        att = " / ".join(f"{r[st]['tenants'][name]['slo_attainment']:.1%}" for st in ("given", "learned", "off"))
        g = {st: r[st]["goodput_rps"] for st in r}
        print(f"{sc:>14} {load:>4}  {g['given']:7.2f} {g['learned']:8.2f} {g['off']:7.2f}  "
              f"{g['learned'] / g['given']:13.3f}  {name}: {att}")
PY
