"""A model's replicas as one call of the core sees them: which are fresh, usable, how full.

Built once per call (`PoolView`), so every layer of one decision reads the same freshness and
usability, instead of each recomputing it. A replica's KV usage (and the pool's saturation, which
`bouncer.core.flow.saturation` computes from it) is remembered until a request is granted there
(`granted`): within one dispatch loop, that is the only thing that moves it.
"""

from __future__ import annotations

from bouncer.config import Policy
from bouncer.core.fleet.replica import ReplicaState


class PoolView:
    __slots__ = ("replicas", "now", "_fresh", "_answering", "_usable", "_reserve", "_project", "_usage",
                 "_pool_usage", "saturation",
                 "_usable_list", "_prompt_workers")

    def __init__(self, replicas: dict[str, ReplicaState], policy: Policy | None, now: float) -> None:
        self.replicas = replicas
        self.now = now
        self._usage: dict[str, float] = {}
        self._pool_usage: float | None = None
        self.saturation: float | None = None  # the detector's last answer on this view, until a grant
        self._fresh: dict[str, bool] = {}
        self._answering: dict[str, bool] = {}
        self._usable: dict[str, bool] = {}  # it may be sent work: listed, and answering (or failing open)
        # those, in order (every arrival asks whether there is one; several layers walk them)
        self._usable_list: list[ReplicaState] = []
        self._prompt_workers: list[ReplicaState] | None = None
        if policy is None:  # a router deployed on its own (a baseline): it trusts what it has
            self._reserve, self._project = False, True
            for name, r in replicas.items():
                self._fresh[name] = self._answering[name] = True
                usable = self._usable[name] = not r.removed and r.healthy
                if usable:
                    self._usable_list.append(r)
            return
        tp = policy.telemetry
        staleness = tp.staleness_s
        fail_open = tp.on_stale == "fail-open"
        self._reserve = policy.kv_reservation == "reserve"
        self._project = policy.project_recent_dispatches
        for name, r in replicas.items():
            t = r.telemetry
            fresh = self._fresh[name] = r.healthy and t is not None and now - t.heard_at <= staleness
            # a replica whose scrape is late but that streams our requests' tokens is serving
            answering = self._answering[name] = fresh or (
                tp.alive_from_streams and r.streamed_at is not None and now - r.streamed_at <= staleness)
            usable = self._usable[name] = not r.removed and (answering or (r.healthy and fail_open))
            if usable:
                self._usable_list.append(r)

    def is_fresh(self, r: ReplicaState) -> bool:
        """Its telemetry is recent and its last scrape answered."""
        return self._fresh[r.name]

    def answering(self, r: ReplicaState) -> bool:
        """Its scrape answered recently, or (its scrape late or failed) it streams tokens to our
        requests: failing closed does not shut it out. Without fresh figures it is judged by
        the gateway's own accounting."""
        return self._answering[r.name]

    def usable(self, r: ReplicaState) -> bool:
        """It may be sent work: listed, and answering (or stale and not failed, failing open)."""
        return self._usable[r.name]

    def usable_replicas(self) -> list[ReplicaState]:
        return self._usable_list

    def prompt_workers(self) -> list[ReplicaState]:
        """The usable replicas that compute prompts (all but a disaggregated fleet's decode
        workers): where a request's TTFT is decided."""
        if self._prompt_workers is None:
            self._prompt_workers = [r for r in self.usable_replicas() if r.role != "decode"]
        return self._prompt_workers

    def any_usable(self) -> bool:
        return bool(self._usable_list)

    def usage(self, r: ReplicaState, fresh: bool | None = None) -> float:
        """KV usage it is heading for (`ReplicaState.projected_usage`, as policy says); `fresh`
        overrides whether its scraped figure counts."""
        name = r.name
        if fresh is not None and fresh != self._fresh[name]:  # (rare: an unhealthy replica's own accounting)
            return r.projected_usage(self.now, fresh, reserve=self._reserve, project=self._project)
        usage = self._usage.get(name)
        if usage is None:
            usage = self._usage[name] = r.projected_usage(self.now, self._fresh[name], reserve=self._reserve,
                                                          project=self._project)
        return usage

    def granted(self, r: ReplicaState) -> None:
        """A request was granted on `r`: its usage, and the pool's saturation, moved."""
        self._usage.pop(r.name, None)
        self.saturation = self._pool_usage = None

    def pool_usage(self) -> float:
        """Mean KV usage over the usable replicas (1.0 with none)."""
        if self._pool_usage is None:
            usages = [self.usage(r) for r in self.usable_replicas()]
            self._pool_usage = sum(usages) / len(usages) if usages else 1.0
        return self._pool_usage
