"""Rate limits several gateways share: each request's verdict comes from the shared store.

The core never waits, so it cannot ask Redis itself. The shell does, before the offer: one atomic
call that checks and charges both of the tenant's buckets, with the charge the core's rate layer
will take (`intake.rate_charge`). It hands the verdict over with `prepay`, then offers the
request, and the rate layer's `take` returns that verdict. A verdict the core did not consume
(an earlier layer refused the request, or its breaker is open) is given back by `unconsumed`, and
the refunds the core makes of charges that passed (a later layer refused the request) wait in
`drain_refunds`, and the settling of served requests' token charges at what they used in
`drain_settled`: the shell sends them all to the shared store.

Without a verdict (the shared store is unreachable and the config says fail-open), `take`
decides here, with this gateway's share of each limit: rate and burst divided by the number of
gateways last seen. `blocked`, the precheck's look that charges nothing, reads the levels the
shared store last reported for the tenant, refilled at the limit's rate since.
"""

from __future__ import annotations

from bouncer.config import RateLimit
from bouncer.core.intake.rate_limit import Bucket, TenantRateLimiter, buckets
from bouncer.core.outcomes import Reason

Verdict = tuple[Reason, float] | None  # refused (why, for how long), or passed and charged


class SharedRateLimits:
    """A `RateLimitStore` whose verdicts the shell fetches from the gateways' shared store."""

    def __init__(self, gateways: int = 1) -> None:
        self.gateways = gateways  # live gateways last counted: this one's share while degraded
        self.degraded = False  # the shared store is unreachable: decide with the local share
        self._limits: dict[str, RateLimit] = {}
        self._share: dict[str, TenantRateLimiter] = {}
        self._levels: dict[str, tuple[float, float | None, float | None]] = {}  # last reported: at, requests, tokens
        self._prepaid: dict[str, list[tuple[int, Verdict]]] = {}
        self._refunds: list[tuple[str, int]] = []
        self._settled: list[tuple[str, int, int]] = []  # tenant, tokens charged, tokens used

    # -- RateLimitStore --------------------------------------------------------------------------
    def configure(self, tenant: str, limits: RateLimit, now: float) -> None:
        if self._limits.get(tenant) != limits:
            self._limits[tenant] = limits
            self._share[tenant] = TenantRateLimiter(limits, now, self.gateways)
            self._levels.pop(tenant, None)

    def take(self, tenant: str, tokens: int, now: float) -> Verdict:
        paid = self._prepaid.get(tenant)
        if paid:
            for i, (charge, verdict) in enumerate(paid):
                if charge == tokens:
                    del paid[i]
                    return verdict
        return self._share[tenant].take(tokens, now)

    def blocked(self, tenant: str, now: float) -> Verdict:
        if self.degraded:
            return self._share[tenant].blocked(now)
        seen = self._levels.get(tenant)
        if seen is None:
            return None
        at, *levels = seen
        for (bucket, level), reason in zip(zip(buckets(self._limits[tenant]), levels, strict=True),
                                           (Reason.RATE_LIMITED_REQUESTS, Reason.RATE_LIMITED_TOKENS), strict=True):
            if bucket is None or level is None:
                continue
            rate, burst = bucket
            level = min(burst, level + max(0.0, now - at) * rate)
            need = min(1.0, burst)
            if level < need:
                return reason, (need - level) / rate
        return None

    def refund(self, tenant: str, tokens: int, now: float) -> None:
        if self.degraded:
            self._share[tenant].refund(tokens, now)
        else:
            self._refunds.append((tenant, tokens))

    def settle(self, tenant: str, charged: int, used: int, now: float) -> None:
        if tenant not in self._share:
            return
        if self.degraded:
            self._share[tenant].settle(charged, used, now)
        elif charged != used:
            self._settled.append((tenant, charged, used))

    def headroom(self, tenant: str, now: float) -> tuple[tuple[float, float, float] | None,
                                                         tuple[float, float, float] | None]:
        """As the shared store last reported the tenant's levels, refilled since (this gateway's
        share of them while the store is away)."""
        if self.degraded or tenant not in self._levels:
            return self._share[tenant].headroom(now) if tenant in self._share else (None, None)
        at, *levels = self._levels[tenant]
        out = []
        for bucket, level in zip(buckets(self._limits[tenant]), levels, strict=True):
            if bucket is None or level is None:
                out.append(None)
                continue
            rate, burst = bucket
            out.append((min(burst, level + max(0.0, now - at) * rate), burst, rate))
        return out[0], out[1]

    # -- the shell's side ------------------------------------------------------------------------
    def limits(self, tenant: str) -> tuple[Bucket | None, Bucket | None]:
        """The tenant's (rate, burst) for requests and tokens, whole (not this gateway's share)."""
        return buckets(self._limits[tenant])

    def prepay(self, tenant: str, tokens: int, verdict: Verdict) -> None:
        """The shared store's verdict for the next request of `tenant` charged `tokens`."""
        self._prepaid.setdefault(tenant, []).append((tokens, verdict))

    def report(self, tenant: str, requests: float | None, tokens: float | None, now: float) -> None:
        """The tenant's levels as the shared store left them at `now`, for `blocked`."""
        self._levels[tenant] = (now, requests, tokens)

    def unconsumed(self) -> list[tuple[str, int]]:
        """The charges that passed in the shared store but were not taken here: to give back."""
        back = [(tenant, charge) for tenant, paid in self._prepaid.items() for charge, verdict in paid
                if verdict is None]
        self._prepaid.clear()
        return back

    def drain_settled(self) -> list[tuple[str, int, int]]:
        """Served requests' token charges to settle in the shared store: (tenant, charged, used)."""
        out, self._settled = self._settled, []
        return out

    def drain_refunds(self) -> list[tuple[str, int]]:
        out, self._refunds = self._refunds, []
        return out

    def set_gateways(self, gateways: int, now: float) -> None:
        """How many gateways share the limits: each one's share while the shared store is away."""
        gateways = max(1, gateways)
        if gateways != self.gateways:
            self.gateways = gateways
            self._share = {t: TenantRateLimiter(limits, now, gateways) for t, limits in self._limits.items()}
