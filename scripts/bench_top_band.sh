#!/usr/bin/env bash
# Regenerate docs/bench/top-band: consolidation's realtime tenant alone (the same arrivals, the
# standard tenant's dropped), Bouncer against no admission, at loads 2.5, 2.75 and 3: what the top
# band gets with the lower band perfectly isolated. Under a minute here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/top-band
mkdir -p "$out"
for load in 2.5 2.75 3; do
  for pol in none bouncer; do
    .venv/bin/bouncer bench run --scenario consolidation --only-tenants realtime --policy "$pol" --load "$load" \
      --duration 120 --replicas 2 --seed 0 --out "$out/consolidation-realtime-$pol-$load.json" > /dev/null
  done
done
python3 - "$out" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())
    print(f"load {r['load']:<5g} {r['policy']:>8}: realtime SLO attainment {r['tenants']['realtime']['slo_attainment']:.1%}")
PY
