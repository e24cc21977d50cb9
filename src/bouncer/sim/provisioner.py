"""An autoscaler: replicas asked for on a signal, ready minutes later.

What a Kubernetes HorizontalPodAutoscaler (or KEDA, which drives one) does with a metric, as
`autoscaling/v2` computes it every `interval_s` (15 s):

- a recommendation from the signal (`Signal`): `ceil(total / target)` for a value summed over
  the fleet (KEDA's Prometheus trigger, AverageValue), or `ceil(ready x mean / target)` for a
  per-replica mean (a Utilization-style target), skipped within the 10% tolerance;
- scale-up at once, by at most max(100%, 4 replicas) per period (the HPA's default policy);
- scale-down to the highest recommendation of the last `scale_down_window_s` (300 s, the HPA's
  default stabilization), which keeps a fleet from shrinking between two bursts;
- within [min_replicas, max_replicas].

A replica asked for is paid from that moment and serves `startup_s` later (driver, weights,
health checks: 5 minutes by default); one taken away finishes what it holds (`FleetSim.retire`)
and is paid until it is empty. `replica_seconds` is the bill.

It drives any `Fleet`: the simulator's (`FleetSim`, in virtual time) or real `bouncer engine`
processes (`bouncer.bench.live_provisioner`, in real time).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

TOLERANCE = 0.1  # the HPA's: a ratio within 10% of 1 changes nothing
SCALE_UP_PODS = 4  # the HPA's default scale-up policy: max(100%, 4 pods) per period


class Fleet(Protocol):
    engines: dict  # every replica still running: serving, or finishing after being taken out

    def serving(self) -> list[str]: ...
    def add_engine(self, name: str, now: float) -> None: ...
    def retire(self, name: str, now: float) -> None: ...


class Averaged:
    """A gauge as Prometheus' `avg_over_time(...[window])` reads it: the mean of its samples in
    the window, each taken when the autoscaler asks."""

    def __init__(self, window_s: float, read: Callable[[float], float]) -> None:
        self.window_s, self.read = window_s, read
        self.samples: deque = deque()

    def __call__(self, fleet: Fleet, now: float) -> float:
        self.samples.append((now, self.read(now)))
        while self.samples[0][0] < now - self.window_s:
            self.samples.popleft()
        return sum(v for _, v in self.samples) / len(self.samples)


@dataclass(frozen=True)
class Signal:
    """What the autoscaler reads, each period: `read(fleet, now)`, and how it becomes replicas:
    `kind` "total" (a fleet-wide sum: ceil(total / target)) or "mean" (a per-replica mean:
    ceil(ready x mean / target))."""

    name: str
    read: Callable[[Fleet, float], float]
    target: float
    kind: str = "total"


@dataclass
class Provisioner:
    signal: Signal
    min_replicas: int = 1
    max_replicas: int = 16
    startup_s: float = 300.0
    interval_s: float = 15.0
    scale_down_window_s: float = 300.0
    prefix: str = "auto"  # names of the replicas it adds
    replica_seconds: float = 0.0
    history: list[dict] = field(default_factory=list)  # per period: time, signal, desired, ready, paid
    _starting: list[tuple[float, str]] = field(default_factory=list)  # (ready at, name)
    _recommendations: deque = field(default_factory=deque)  # (time, recommendation)
    _next: int = 0
    _last: float | None = None
    _due: float = 0.0

    def step(self, fleet: Fleet, now: float) -> None:
        """Called often (every few simulated seconds): replicas whose start-up is over join the
        fleet, the bill runs, and every `interval_s` the autoscaler decides."""
        if self._last is not None:
            self.replica_seconds += (now - self._last) * self.paid(fleet)
        self._last = now
        for ready_at, name in list(self._starting):
            if ready_at <= now:
                self._starting.remove((ready_at, name))
                fleet.add_engine(name, now)
        if now < self._due:
            return
        self._due = now + self.interval_s
        ready = len(fleet.serving())
        value = self.signal.read(fleet, now)
        wanted = self._recommend(value, ready, len(self._starting))
        if not self._recommendations:  # as if it had been running: the fleet's size was its last word
            self._recommendations.append((now, ready + len(self._starting)))
        self._recommendations.append((now, wanted))
        while self._recommendations[0][0] < now - self.scale_down_window_s:
            self._recommendations.popleft()
        current = ready + len(self._starting)
        if wanted > current:
            desired = min(wanted, max(2 * current, current + SCALE_UP_PODS))
        else:
            desired = max(r for _, r in self._recommendations)  # stabilised: the highest of the window
            desired = min(desired, current)
        desired = max(self.min_replicas, min(self.max_replicas, desired))
        for _ in range(desired - current):
            self._starting.append((now + self.startup_s, f"{self.prefix}{self._next}"))
            self._next += 1
        for _ in range(current - desired):
            self._take_one(fleet, now)
        self.history.append({"t": now, "signal": round(value, 4), "desired": desired, "ready": len(fleet.serving()),
                             "paid": self.paid(fleet)})

    def _recommend(self, value: float, ready: int, starting: int) -> int:
        s = self.signal
        if s.kind == "total":
            return math.ceil(value / s.target - 1e-9)
        base = ready + starting
        ratio = value / s.target
        if abs(ratio - 1) <= TOLERANCE:
            return base
        return math.ceil(max(ready, 1) * ratio - 1e-9)

    def _take_one(self, fleet: Fleet, now: float) -> None:
        """A replica still starting goes first (the newest); else the newest serving one."""
        if self._starting:
            self._starting.pop()
            return
        serving = fleet.serving()
        if serving:
            fleet.retire(serving[-1], now)

    def paid(self, fleet: Fleet) -> int:
        """Replicas paid for now: serving, finishing after being taken out, and starting."""
        return len(fleet.engines) + len(self._starting)
