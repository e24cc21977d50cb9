"""A spent quota, as the core acts on it. The shell looks the tenant's spend up before the offer
(it lives in Redis, `bouncer.quotas`) and hands the finding over on the request
(`RequestInfo.over_quota`); the core applies the tenant's choice at the rate layer, before any
rate limit is charged:
- refuse: 429 `quota_exhausted`, Retry-After the time until the spent windows reset, and
  `x-should-retry: false` when that is past the request's TTL (waiting cannot help it);
- demote: it runs in the tenant's `demote_band` (sheddable), first to go under load;
- divert: it goes to the model's overflow targets (`bouncer.core.fleet.overflow`), else refused.
With the store unreachable and `on_unavailable: fail-closed`, the shell's finding is
"unavailable": 503 `shared_state_unavailable`.

A demotion is remembered until the spent windows reset, or until the shell finds the tenant
within its quota again (an operator's reset): the precheck, which runs before the shell has
looked, then judges the tenant's requests in the band they will run in, so that what it refuses
of them (a retry past its deadline, say) counts against that band, not the tenant's own.
"""

from __future__ import annotations

from bouncer.config import Tenant
from bouncer.core.outcomes import RETRY_AFTER_MIN_S, Layer, Reason, Refusal
from bouncer.core.requests import OverQuota

UNAVAILABLE_RETRY_S = 1.0


def refusal(over: OverQuota, ttl_s: float) -> Refusal:
    """`over` as its client hears it: spent (429), or the store unreachable (503, fail-closed)."""
    if over.action == "unavailable":
        return Refusal(Layer.RATE, Reason.SHARED_STATE_UNAVAILABLE, over.limit, UNAVAILABLE_RETRY_S)
    return Refusal(Layer.RATE, Reason.QUOTA_EXHAUSTED,
                   f"quota exhausted: {over.limit}; it resets in {_duration(over.resets_in_s)}",
                   max(RETRY_AFTER_MIN_S, over.resets_in_s), retryable=over.resets_in_s <= ttl_s)


def demoted(t: Tenant, over: OverQuota) -> Tenant:
    """`t` in its over-quota band (never a higher one than its own)."""
    return t if over.band >= t.priority else t.model_copy(update={"priority": over.band})


class Demotions:
    """Tenants demoted past their quota, until when, and into which band."""

    def __init__(self) -> None:
        self._until: dict[str, tuple[float, OverQuota]] = {}

    def note(self, tenant: str, over: OverQuota | None, now: float) -> None:
        """What the shell found of a request of `tenant` (None: within its quota, or no quota)."""
        if over is not None and over.action == "demote":
            self._until[tenant] = (now + over.resets_in_s, over)
        elif self._until:
            self._until.pop(tenant, None)

    def applied(self, t: Tenant, now: float) -> Tenant:
        """`t` as demoted now, if it is."""
        found = self._until.get(t.name) if self._until else None
        if found is None:
            return t
        if now >= found[0]:
            del self._until[t.name]
            return t
        return demoted(t, found[1])


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
