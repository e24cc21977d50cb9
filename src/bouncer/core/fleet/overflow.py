"""Overflow: where a request goes that its model's pool would refuse.

Admission's fourth answer beside admit, hold and shed: divert. A request refused for load (the
pool saturated, the waiting room full, its TTL spent in the queue, its deadline infeasible, no
replica), from a tenant with `overflow: true`, or one whose tenant's quota is spent with `over:
divert`, is sent to the first of its model's `overflow` targets that has room under its own rate
limit (a token bucket per gateway): another model's pool of this config, or an external
OpenAI-compatible endpoint. Where none has room, it is refused as it would have been.

A request diverted to another pool is admitted there as usual but never diverted again, so
targets cannot send work in circles.
"""

from __future__ import annotations

from bouncer.config import BouncerConfig
from bouncer.core.intake.rate_limit import TokenBucket
from bouncer.core.outcomes import Reason
from bouncer.core.requests import RequestInfo
from bouncer.quotas.settings import OverflowTarget

DIVERTIBLE = frozenset({Reason.SATURATED, Reason.QUEUE_FULL, Reason.TENANT_QUEUE_FULL, Reason.EVICTED,
                        Reason.TTL_EXPIRED, Reason.DEADLINE_INFEASIBLE, Reason.NO_BACKEND})


class Overflow:
    def __init__(self) -> None:
        self._targets: dict[str, list[tuple[OverflowTarget, TokenBucket | None]]] = {}
        self._allowed: frozenset[str] = frozenset()

    def reconfigure(self, config: BouncerConfig, now: float) -> None:
        """The config's targets; a target whose settings are unchanged keeps its bucket's level."""
        old = {(model, t.name): (t, b) for model, targets in self._targets.items() for t, b in targets}
        self._targets = {}
        for m in config.models:
            targets = []
            for t in m.overflow:
                kept = old.get((m.name, t.name))
                if kept is not None and kept[0] == t:
                    targets.append(kept)
                    continue
                bucket = TokenBucket(t.requests_per_s, t.burst or max(1.0, 2 * t.requests_per_s), now) \
                    if t.requests_per_s else None
                targets.append((t, bucket))
            if targets:
                self._targets[m.name] = targets
        self._allowed = frozenset(t.name for t in config.tenants if t.overflow)

    def may_take(self, info: RequestInfo, tenant: str, reason: Reason | str) -> bool:
        """Whether a refusal for `reason` of this request could be diverted (its targets' rate
        limits not looked at): the precheck then leaves it to `offer`, which tokenizes it first
        (a quota and another pool both need its prompt)."""
        return (info.diverted_from is None and bool(self._targets.get(info.model))
                and reason in DIVERTIBLE and tenant in self._allowed)

    def target(self, model: str, tenant: str, reason: Reason | str, now: float) -> OverflowTarget | None:
        """The target a request refused for `reason` goes to instead (its bucket charged), or
        None: it is not divertible, or no target has room."""
        targets = self._targets.get(model)
        if not targets:
            return None
        if not (reason == Reason.QUOTA_EXHAUSTED or (reason in DIVERTIBLE and tenant in self._allowed)):
            return None
        for t, bucket in targets:
            if bucket is None:
                return t
            if bucket.wait_time(1, now) == 0:
                bucket.take(1, now)
                return t
        return None

    def targets(self, model: str) -> list[OverflowTarget]:
        return [t for t, _ in self._targets.get(model, [])]
