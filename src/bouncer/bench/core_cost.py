"""`bouncer bench core`: what the admission core costs per call, on a simulated workload.

Two steps, so that the core alone is measured and two revisions can be compared on the very same
calls:
- `record`: one goodput run (`bench run`'s setup: a scenario at a load, Bouncer's policy), with
  every call the simulator makes on the core written down (entry point, arguments) with the config;
- `replay`: a fresh core fed those calls in order, each timed. The core is deterministic, so a
  replay decides exactly what the recorded run decided, on any revision whose entry points take
  the same arguments; nothing but the core runs while it is timed. It also digests every call's
  events (`decisions_sha256`, hashed outside the timed span): two revisions whose digests are
  equal decided alike on every call, the check that a change meant only to be faster is exact
  (a change to an event's fields or their repr shows as a difference too).

`scripts/bench_core_cost.sh REV` records once and replays on REV and on this tree, alternating,
and reports the fastest replay of each (the least disturbed by a noisy machine), per entry point.
A replay also sorts each `offer` and `tick` by how many requests were queued when it was made
(`by_queue`), and by how many requests the core had refused or expired in the second of the
run's clock before it (`by_refusals`, per second): a cost that grows with the backlog, or with a
flood of refusals and the retries they bring back, shows there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pickle
import statistics
import time
from collections import defaultdict, deque

ENTRY_POINTS = ("offer", "tick", "started", "finished", "observe", "cancel", "requeue", "renew", "kv_digests")


QUEUE_BUCKETS = (10, 100, 1000, 10_000)  # upper bounds (exclusive) of the queue depths calls are sorted by
REFUSAL_BUCKETS = (10, 100, 1000, 10_000)  # the same for refusals per second
BY_QUEUE = ("offer", "tick")


def record(path: str, scenario: str = "surge", load: float = 2.0, duration_s: float = 120.0, replicas: int = 2,
           seed: int = 0, trace: str | None = None) -> int:
    """Run the scenario and write its core calls to `path`; returns how many."""
    from bouncer.bench import goodput
    from bouncer.sim import policies

    calls: list[tuple[str, tuple, dict]] = []
    configs = []
    original = policies.CorePolicy.__init__

    def recording_init(self, name, config, *args, **kwargs):
        original(self, name, config, *args, **kwargs)
        configs.append(config.model_dump(mode="json", exclude_defaults=True))
        core = self.core
        for entry in ENTRY_POINTS:
            call = getattr(core, entry)

            def wrapper(*a, _call=call, _entry=entry, **k):
                calls.append((_entry, _portable(a if _entry != "renew" else (list(a[0]), *a[1:])), k))
                return _call(*a, **k)
            setattr(core, entry, wrapper)  # this run's core only: an instrument, not a change

    policies.CorePolicy.__init__ = recording_init
    try:
        goodput.simulate(scenario, "bouncer", load, seed, replicas, duration_s, trace)
    finally:
        policies.CorePolicy.__init__ = original
    with open(path, "wb") as f:
        pickle.dump({"config": configs[-1], "calls": calls, "scenario": scenario, "load": load,
                     "duration_s": duration_s, "replicas": replicas, "seed": seed, "trace": trace}, f)
    return len(calls)


def _portable(args: tuple) -> tuple:
    """A call's arguments, each `RequestInfo` as its fields: a recording replays on a tree whose
    RequestInfo has gained or lost fields (`scripts/bench_core_cost.sh`'s other revision)."""
    from bouncer.core.requests import RequestInfo

    return tuple(("RequestInfo", {f.name: getattr(a, f.name) for f in dataclasses.fields(a)})
                 if isinstance(a, RequestInfo) else a for a in args)


def _restored(args: tuple) -> tuple:
    """`_portable`'s arguments back, with the fields this tree's RequestInfo has."""
    from bouncer.core.requests import RequestInfo

    known = {f.name for f in dataclasses.fields(RequestInfo)}
    return tuple(RequestInfo(**{k: v for k, v in a[1].items() if k in known})
                 if isinstance(a, tuple) and len(a) == 2 and a[0] == "RequestInfo" else a for a in args)


def replay(path: str) -> dict:
    """Feed a fresh core the recorded calls; seconds spent per entry point."""
    from bouncer.config import parse_config
    from bouncer.core.admission import AdmissionCore
    from bouncer.core.outcomes import Reject

    with open(path, "rb") as f:
        recorded = pickle.load(f)
    core = AdmissionCore(parse_config(recorded["config"]), 0.0)
    spent: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    # (entry, bucket) -> [n, s]: by requests queued, and by refusals in the second before
    by_queue: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    by_refusals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    refused: deque[float] = deque()  # when the core refused or expired a request, by the run's clock
    now = 0.0  # the run's clock, as the last `offer` or `tick` gave it (the other calls come between)
    clock = time.perf_counter
    decisions = hashlib.sha256()
    for entry, args, kwargs in recorded["calls"]:
        call = getattr(core, entry)
        args = _restored(args)
        if entry in BY_QUEUE:  # outside the timed span
            depth = core.view.queued
            now = args[1] if entry == "offer" else args[0]
            while refused and refused[0] < now - 1.0:
                refused.popleft()
            rate = len(refused)
        t0 = clock()
        events = call(*args, **kwargs)
        took = clock() - t0
        decisions.update(repr(events).encode())
        refused.extend(now for event in events or () if isinstance(event, Reject))
        spent[entry] += took
        counts[entry] += 1
        if entry in BY_QUEUE:
            for cells, value, bounds in ((by_queue, depth, QUEUE_BUCKETS), (by_refusals, rate, REFUSAL_BUCKETS)):
                cell = cells[(entry, _bucket(value, bounds))]
                cell[0] += 1
                cell[1] += took
    return {"calls": {e: {"n": counts[e], "seconds": spent[e], "mean_us": spent[e] / counts[e] * 1e6}
                      for e in counts}, "total_seconds": sum(spent.values()),
            "by_queue": _cells(by_queue), "by_refusals": _cells(by_refusals),
            "decisions_sha256": decisions.hexdigest()}


def _cells(cells: dict[tuple[str, str], list[float]]) -> dict[str, dict[str, dict]]:
    return {e: {b: {"n": n, "mean_us": s / n * 1e6} for (e2, b), (n, s) in cells.items() if e2 == e}
            for e in BY_QUEUE}


def _bucket(value: int, bounds: tuple[int, ...]) -> str:
    low = 0
    for high in bounds:
        if value < high:
            return f"{low}-{high - 1}"
        low = high
    return f"{low}+"


def main(scenario: str, load: float, duration_s: float, replicas: int, out_path: str | None,
         repeats: int = 5, trace: str | None = None) -> None:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".pickle") as f:
        n = record(f.name, scenario, load, duration_s, replicas, trace=trace)
        runs = [replay(f.name) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["total_seconds"])
    print(f"core cost on {scenario} at load {load:g}, {replicas} replicas: {n} calls replayed "
          f"(fastest of {repeats} replays: {best['total_seconds']:.2f} s)")
    for entry, c in sorted(best["calls"].items(), key=lambda kv: -kv[1]["seconds"]):
        spread = [r["calls"][entry]["mean_us"] for r in runs]
        print(f"  {entry:>10}: {c['n']:>7} calls, {c['mean_us']:7.1f} us each "
              f"(replays: {min(spread):.1f}-{max(spread):.1f}, median {statistics.median(spread):.1f})")
    for key, what in (("by_queue", "requests queued"), ("by_refusals", "refusals in the second before")):
        for entry in BY_QUEUE:
            cells = sorted(best[key][entry].items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+")))
            print(f"  {entry:>10} by {what}: " + ", ".join(f"{b}: {c['mean_us']:.1f} us ({c['n']})" for b, c in cells))
    if out_path:
        with open(out_path, "w") as out:
            json.dump({"scenario": scenario, "load": load, "duration_s": duration_s, "replicas": replicas,
                       "trace": trace, "calls": n, "best": best, "runs": runs}, out, indent=1)
