#!/usr/bin/env bash
# The admission core's cost per call on this tree against another revision, on the same calls, in
# one run on the same machine: `bouncer bench core`'s record and replay (bouncer/bench/core_cost.py).
# One simulated run (surge, load 2, 120 s, 2 replicas) is recorded, then replayed on REV and on
# this tree, alternating, 5 times each; the fastest replay of each is reported (the least
# disturbed), and docs/bench/core-cost.json saved (OUT= another path). Another workload: RECORD=
# `record`'s keyword arguments, e.g. the high-rate pool of issue 18:
#   RECORD="load=3, duration_s=30, replicas=4, trace='data/traces/servegen/m-mid'" \
#     OUT=docs/bench/core-cost-m-mid-ab.json scripts/bench_core_cost.sh REV
# usage: scripts/bench_core_cost.sh [REV]
set -euo pipefail
cd "$(dirname "$0")/.."
rev=$(git rev-parse --short "${1:-HEAD~1}")  # saved as a commit, which stays true after more commits
work=$(mktemp -d)
trap 'git worktree remove --force "$work/old" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add -q --detach "$work/old" "$rev"
cp src/bouncer/bench/core_cost.py "$work/core_cost_tool.py"  # the same measurement on both trees
export BOUNCER_CACHE_DIR="$work/cache"
PYTHONPATH="$PWD/src:$work" .venv/bin/python -c "import core_cost_tool; core_cost_tool.record('$work/calls.pickle', ${RECORD:-})"
for i in 1 2 3 4 5; do
  for tree in old new; do
    src=$([ "$tree" = old ] && echo "$work/old/src" || echo "$PWD/src")
    PYTHONPATH="$src:$work" .venv/bin/python -c "
import json, core_cost_tool
r = core_cost_tool.replay('$work/calls.pickle')
r['tree'] = '$tree'
print(json.dumps(r))" >> "$work/runs.jsonl"
  done
done
.venv/bin/python - "$work/runs.jsonl" "$rev" "${OUT:-docs/bench/core-cost.json}" "$work/calls.pickle" <<'PY'
import json, pickle, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
best = {tree: min((r for r in runs if r["tree"] == tree), key=lambda r: r["total_seconds"]) for tree in ("old", "new")}
with open(sys.argv[4], "rb") as f:
    rec = pickle.load(f)
print(f"core cost per call, replaying one recorded run ({rec['scenario']}, load {rec['load']:g}, {rec['duration_s']:g} s, "
      f"{rec['replicas']} replicas{', ' + rec['trace'] if rec['trace'] else ''}), fastest of 5 replays each:")
print(f"  {'':>10}  {sys.argv[2]:>12}  {'this tree':>12}")
for name in ("offer", "tick", "finished", "observe", "started"):
    old, new = best["old"]["calls"].get(name), best["new"]["calls"].get(name)
    if old and new:
        print(f"  {name:>10}: {old['mean_us']:9.1f} us  {new['mean_us']:9.1f} us  ({new['mean_us'] / old['mean_us']:.2f}x, "
              f"{new['n']} calls)")
print(f"  {'all':>10}: {best['old']['total_seconds']:9.2f} s   {best['new']['total_seconds']:9.2f} s   "
      f"({best['new']['total_seconds'] / best['old']['total_seconds']:.2f}x)")
digests = {tree: {r["decisions_sha256"] for r in runs if r["tree"] == tree} for tree in ("old", "new")}
print("decisions: " + ("identical on every call" if digests["old"] == digests["new"] and len(digests["old"]) == 1
                       else "DIFFER between the trees (or between replays): not an exact change"))
json.dump({"revision": sys.argv[2], "record": {k: rec[k] for k in ("scenario", "load", "duration_s", "replicas", "trace")},
           "best": best, "runs": runs}, open(sys.argv[3], "w"), indent=1)
PY
