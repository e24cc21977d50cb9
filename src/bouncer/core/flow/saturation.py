"""Saturation: one number for a model's pool, and the ceiling each band may dispatch under.

Contract of a `SaturationDetector` (checked for each in tests/conformance): `saturation(view)`
is a number >= 0 where >= 1.0 means saturated; it does not decrease when a replica's load grows,
and it counts a replica it cannot see (unhealthy, or stale when failing closed) as saturated.
A band dispatches only while the pool's saturation is under its ceiling (`ceiling`): sheddable
bands stop first, protected ones may run the pool hotter. Registered by name in
`bouncer.core.registry`; docs/policies/saturation-utilization.md.
"""

from __future__ import annotations

from typing import Protocol

from bouncer.config import Policy
from bouncer.core.fleet.pool import PoolView


class SaturationDetector(Protocol):
    name: str

    def saturation(self, view: PoolView) -> float: ...


class UtilizationDetector:
    """llm-d's utilization detector: per replica max(queue / queue threshold, KV / KV threshold),
    averaged over the pool. A stale replica counts as fully saturated when failing closed, and
    by our own accounting alone when failing open; an unhealthy one (failed scrape) is saturated.
    One whose scrape is late but that streams tokens to our requests (`PoolView.answering`) is
    judged by our own accounting, whichever the failure mode."""

    name = "utilization"

    def __init__(self, policy: Policy) -> None:
        self.queue_threshold = policy.saturation.queue_depth_threshold
        self.kv_threshold = policy.saturation.kv_threshold
        self.fail_closed = policy.telemetry.on_stale == "fail-closed"

    def saturation(self, view: PoolView) -> float:
        if view.saturation is None:
            view.saturation = self._compute(view)
        return view.saturation

    def _compute(self, view: PoolView) -> float:
        values = []
        for r in view.replicas.values():
            if r.removed:
                continue
            is_fresh = r.healthy and view.is_fresh(r)
            if not is_fresh and not view.answering(r) and (not r.healthy or self.fail_closed):
                values.append(1.0)
                continue
            # a decode worker's KV is planned full (`bouncer.core.fleet.decode_room` keeps it in
            # bounds): only its queue says it is overloaded
            kv = 0.0 if r.role == "decode" else view.usage(r, is_fresh) / self.kv_threshold
            values.append(max(r.queue_depth(is_fresh) / self.queue_threshold, kv))
        return sum(values) / len(values) if values else 1.0


def ceiling(policy: Policy, priority: int) -> float:
    """The saturation under which a band may dispatch."""
    if priority in policy.band_ceilings:
        return policy.band_ceilings[priority]
    if priority < 0:
        return policy.sheddable_ceiling
    return policy.priority_ceiling if priority > 0 else policy.default_ceiling
