#!/usr/bin/env bash
# Issue 51's top-band target on ServeGen's banded pools: the top band's SLO attainment in the mix
# (Bouncer's saved runs) against the same band alone (the same arrivals, the lower band's
# dropped), at loads 2 and 3. Writes docs/bench/top-band-servegen; a few minutes here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/top-band-servegen
mkdir -p "$out"
run() {  # pool saved-mix-run replicas duration load
  local top
  top=$(python3 -c "import json,sys; t=json.load(open(sys.argv[1]))['tenants']; p=max(v['priority'] for v in t.values()); print(','.join(k for k, v in t.items() if v['priority'] == p))" "$2")
  .venv/bin/bouncer bench run --scenario surge --trace "data/traces/servegen/$1" --policy bouncer --load "$5" \
    --duration "$4" --replicas "$3" --only-tenants "$top" --out "$out/$1-$5.json" > /dev/null
  python3 - "$2" "$out/$1-$5.json" "$1" "$5" <<'PY'
import json, sys
def band(path):
    t = json.load(open(path))["tenants"]
    top = max(v["priority"] for v in t.values())
    xs = [v for v in t.values() if v["priority"] == top]
    return sum(v["slo_attainment"] * v["offered"] for v in xs) / sum(v["offered"] for v in xs)
mix, alone = band(sys.argv[1]), band(sys.argv[2])
print(f"{sys.argv[3]} load {sys.argv[4]}: top band {mix:.2%} in the mix, {alone:.2%} alone ({(mix - alone) * 100:+.2f} points)")
PY
}
for load in 2 3; do
  run m-mid "docs/bench/servegen-m-mid/surge-m-mid-bouncer-$load.json" 4 60 "$load"
  run m-large "docs/bench/servegen-m-large/surge-m-large-bouncer-$load.json" 4 60 "$load"
  run deepseek-r1 "docs/bench/servegen/surge-servegen-bouncer-$load.json" 2 120 "$load"
done
