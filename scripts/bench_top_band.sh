#!/usr/bin/env bash
# Regenerate docs/bench/top-band: consolidation's realtime tenant alone (the same arrivals, the
# standard tenant's dropped), Bouncer against no admission, at loads 1 to 3: what the top
# band gets with the lower band perfectly isolated; then where in the run the band's demand and
# misses fall. Under a minute here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/top-band
mkdir -p "$out"
for load in 1 1.5 2 2.5 2.75 3; do
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
# At load 3, per 10 s of arrivals: the realtime band's own demand against the fleet's capacity
# (the mix's saturated completion rate) in requests, and in tokens (prompt + output, over capacity
# x the mix's mean tokens per request); and the realtime requests that missed their SLO under
# Bouncer, alone and in the mix.
.venv/bin/python - <<'PY'
from collections import Counter

from bouncer.bench import goodput


def window(r) -> int:
    return int(r.arrival // 10)


def realtime_misses(only_tenants) -> Counter:
    *_, result = goodput.simulate("consolidation", "bouncer", 3, 0, 2, 120, only_tenants=only_tenants)
    return Counter(window(r) for r in result.requests if r.tenant == "realtime" and not goodput.within_slo(r))


_, capacity, mix, _ = goodput.simulate("consolidation", "none", 3, 0, 2, 120)
mean_tokens = sum(r.prompt_len + r.output_len for r in mix) / len(mix)
requests, tokens = Counter(), Counter()
for r in mix:
    if r.tenant == "realtime":
        requests[window(r)] += 1
        tokens[window(r)] += r.prompt_len + r.output_len
alone, in_mix = realtime_misses(["realtime"]), realtime_misses(None)
print("realtime at load 3, per 10 s of arrivals: requests / capacity, tokens / (capacity x mean tokens), "
      "requests, missed alone, missed in the mix")
for w in sorted(requests):
    print(f"  {10 * w:>3}-{10 * w + 10:<3} s  {requests[w] / 10 / capacity:.2f}  "
          f"{tokens[w] / 10 / (capacity * mean_tokens):.2f}  {requests[w]:>4}  {alone[w]:>3}  {in_mix[w]:>3}")
print(f"  all        {sum(requests.values()) / 120 / capacity:.2f}        {sum(requests.values()):>5}  "
      f"{sum(alone.values()):>3}  {sum(in_mix.values()):>3}")
PY
