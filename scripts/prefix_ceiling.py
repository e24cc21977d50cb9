"""What any router could reach in the `prefix` scenario: offline ceilings on the same requests.

Prints, for the requests `bouncer bench run --scenario prefix` offers at a load:
- the infinite-cache bound (one cache that never evicts; the result JSON's prefix_hit_bound);
- one LRU cache the size of the whole fleet's GPU KV, which no router can beat without a host tier;
- an oracle router (each request to the replica holding its longest prefix, new conversations to
  the least loaded) over per-replica LRU caches of GPU plus host blocks.

Usage: .venv/bin/python scripts/prefix_ceiling.py [--load 0.8] [--duration 300] [--replicas 8]
"""

from __future__ import annotations

import argparse
from collections import OrderedDict

from bouncer.bench.goodput import DEFAULT_PROFILE, fleet_capacity, prefix_hit_bound
from bouncer.core.fleet.blocks import leading_run
from bouncer.sim.profiles import get_profile
from bouncer.sim.scenarios import get_scenario
from bouncer.sim.workloads import make_requests


def lru_hit_rate(requests, caches: int, capacity: int, pick) -> float:
    lru = [OrderedDict() for _ in range(caches)]
    load = [0] * caches
    hits = total = 0
    for i, r in enumerate(requests):
        matched = [leading_run(r.block_digests, c) for c in lru]
        k = pick(i, matched, load)
        hits += min(matched[k] * 16, r.prompt_len - 1)
        total += r.prompt_len
        c = lru[k]
        for d in r.block_digests:
            c[d] = None
            c.move_to_end(d)
        while len(c) > capacity:
            c.popitem(last=False)
        load[k] += r.prompt_len
    return hits / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--load", type=float, default=0.8)
    ap.add_argument("--duration", type=float, default=300.0)
    ap.add_argument("--replicas", type=int, default=8)
    args = ap.parse_args()
    scenario = get_scenario("prefix", args.duration)
    traces = scenario.load()
    capacity = fleet_capacity(scenario, traces, args.replicas, DEFAULT_PROFILE, 0, None)
    requests = sorted(make_requests(scenario.tenants, traces, args.load * capacity, args.duration, 0),
                      key=lambda r: r.arrival)
    profile = get_profile(DEFAULT_PROFILE)
    gpu, host = profile.num_blocks, profile.offload_blocks(scenario.cpu_offload_gib)
    bound = prefix_hit_bound(requests, 16)
    pooled = lru_hit_rate(requests, 1, gpu * args.replicas, lambda i, m, load: 0)
    system_prompt_blocks = 512 // 16  # Mooncake's hash id 0, shared by nearly every prompt

    def oracle(i, matched, load):
        if max(matched) <= system_prompt_blocks:
            return min(range(len(load)), key=load.__getitem__)
        return max(range(len(load)), key=lambda k: (matched[k], -load[k]))
    routed = lru_hit_rate(requests, args.replicas, gpu + host, oracle)
    print(f"{len(requests)} requests at load {args.load:g} ({args.duration:g} s, {args.replicas} replicas)")
    print(f"infinite-cache bound:                         {bound:.1%}")
    print(f"one LRU cache of the fleet's GPU KV:          {pooled:.1%}  ({pooled / bound:.0%} of the bound)")
    print(f"oracle router, GPU + {scenario.cpu_offload_gib:g} GiB host per replica: {routed:.1%}  "
          f"({routed / bound:.0%} of the bound)")


if __name__ == "__main__":
    main()
