#!/usr/bin/env bash
# Regenerate docs/bench/gateways-sim: several gateways in the fleet simulator (issue #19). Each
# scenario of the main matrix at loads 1-3 with one gateway, three independent gateways (each
# counting only its own requests and enforcing every limit alone, as llm-d's active-active mode
# does), and three sharing state as on Redis, seen 2 ms and 20 ms late; clients spread per request
# (a Kubernetes Service); for fairness, and the gateways scenario (a top band beside two same-band
# tenants, one bursting), also per tenant: each tenant on its own gateway.
# About 12 minutes on this project's 2-core machine (two runs at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/gateways-sim
mkdir -p "$out"
jobs=()
for sc in rogue-tenant consolidation surge fairness; do
  for load in 1 2 3; do
    jobs+=("$sc $load bouncer 1-gateway")
    jobs+=("$sc $load llmd-flow-control 1-gateway")
    jobs+=("$sc $load llmd-flow-control 3-independent --gateways 3")
    jobs+=("$sc $load bouncer 3-independent --gateways 3")
    jobs+=("$sc $load bouncer 3-shared-2ms --gateways 3 --state-delay-ms 2")
    jobs+=("$sc $load bouncer 3-shared-20ms --gateways 3 --state-delay-ms 20")
  done
done
for load in 1 2 3; do
  for sc in fairness gateways; do
    jobs+=("$sc $load bouncer 3-independent-by-tenant --gateways 3 --spread tenant")
    jobs+=("$sc $load bouncer 3-shared-2ms-by-tenant --gateways 3 --state-delay-ms 2 --spread tenant")
  done
  jobs+=("gateways $load bouncer 1-gateway")
  jobs+=("gateways $load llmd-flow-control 1-gateway")
  jobs+=("gateways $load llmd-flow-control 3-independent-by-tenant --gateways 3 --spread tenant")
done
printf '%s\n' "${jobs[@]}" | xargs -P 2 -L 1 bash -c \
  '.venv/bin/bouncer bench run --scenario "$0" --load "$1" --policy "$2" "${@:4}" --duration 120 --replicas 2 \
     --out "'"$out"'/$0-$1-$2-$3.json" > /dev/null'
.venv/bin/python - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = {}
for f in sorted(out.glob("*-*.json")):
    if f.name == "summary.json":
        continue
    r = json.loads(f.read_text())
    setup = f.stem.split(f"-{r['load']:g}-", 1)[1]
    rows.setdefault((r["scenario"], r["load"]), {})[setup] = r
summary = []
for (sc, load), by in sorted(rows.items()):
    print(f"{sc} load {load:g}")
    for setup, r in sorted(by.items()):
        t = r["tenants"]
        line = {"scenario": sc, "load": load, "setup": setup, "goodput_rps": round(r["goodput_rps"], 2),
                "slo_attainment": {k: round(v["slo_attainment"], 4) for k, v in t.items()},
                "token_share": {k: round(v["served_token_share"], 3) for k, v in t.items()},
                "late_on_retry": sum(v["slo_misses"].get("late_ttft_on_retry", 0) for v in t.values()),
                "wall_s": round(r["wall_seconds"], 1)}
        summary.append(line)
        print(f"  {setup:>42}: goodput {line['goodput_rps']:7.2f}  attainment {line['slo_attainment']}  "
              f"shares {line['token_share']}  late on retry {line['late_on_retry']}")
(out / "summary.json").write_text(json.dumps(summary, indent=1))
PY
