#!/usr/bin/env bash
# The `prefix` scenario (Mooncake conversations, approximate prefix indexes: no KV events) through
# one gateway, three independent and three sharing state 2 ms late, clients spread per request:
# what sharing the blocks each gateway sent (bouncer/core/sharing/prefixes.py) keeps of prefix
# routing. Results in docs/bench/prefix-gateways (docs/benchmarks/several-gateways.md). About 2 minutes here.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/bench/prefix-gateways}
mkdir -p "$out"
for load in 0.8 1.2; do
  .venv/bin/bouncer bench run --scenario prefix --policy bouncer --load "$load" --out "$out/one-$load.json" >/dev/null
  .venv/bin/bouncer bench run --scenario prefix --policy bouncer --load "$load" --gateways 3 \
    --out "$out/independent-$load.json" >/dev/null
  .venv/bin/bouncer bench run --scenario prefix --policy bouncer --load "$load" --gateways 3 --state-delay-ms 2 \
    --out "$out/sharing-$load.json" >/dev/null
done
.venv/bin/python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
print("| load | gateways | prefix hit rate | TTFT p50 s | TTFT p99 s | goodput req/s |")
print("|---|---|---|---|---|---|")
for load in ("0.8", "1.2"):
    for setup in ("one", "independent", "sharing"):
        r = json.loads((out / f"{setup}-{load}.json").read_text())
        print(f"| {load} | {setup} | {r['prefix_hit_rate']:.1%} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
              f"{r['goodput_rps']:.2f} |")
PY
