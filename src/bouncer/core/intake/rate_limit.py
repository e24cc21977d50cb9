"""Per-tenant rate limits: token buckets with time passed in, behind a store.

A bucket holds up to `burst` units and refills at `rate` units per second. Taking more than it
holds is refused with the time until it would hold enough: that is the Retry-After. Each tenant
has a request bucket and a token bucket (prompt + max_tokens), either optional.

`RateLimitStore` is what the core asks: `take` charges a request if both buckets allow it (else
says which limit and for how long), and `refund` gives a charge back, for a request a later,
costlier layer refused (the waiting room was full, say): a limit counts what the fleet took on.
`settle` settles a served request's token charge at what it used: a request is charged its prompt
and all of max_tokens when it passes (what it may use), and given back what it did not use when
it ends, or charged more where it used more than counted (its bucket may then go below empty, and
the tenant waits it out).
`LocalRateLimits` keeps the buckets in this process; a shared store keeps them where several
gateways see the same ones.
"""

from __future__ import annotations

from typing import Protocol

from bouncer.config import RateLimit
from bouncer.core.outcomes import Reason


class TokenBucket:
    __slots__ = ("rate", "burst", "level", "updated")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("rate and burst must be positive")
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.burst, self.level + (now - self.updated) * self.rate)
            self.updated = now

    def wait_time(self, amount: float, now: float) -> float:
        """Seconds until `amount` could be taken (0 if now). Amounts above the burst are
        treated as a full bucket, so one huge request is slowed, not refused forever."""
        self._refill(now)
        amount = min(amount, self.burst)
        return 0.0 if self.level >= amount else (amount - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level -= min(amount, self.burst)

    def give_back(self, amount: float, now: float) -> None:
        self._refill(now)
        self.level = min(self.burst, self.level + min(amount, self.burst))


Bucket = tuple[float, float]  # (rate per second, burst)


def buckets(cfg: RateLimit, share: int = 1) -> tuple[Bucket | None, Bucket | None]:
    """The (rate, burst) of a tenant's request and token buckets, None where it has no such
    limit; with `share` N, one gateway's Nth of each (rate and burst divided by N)."""
    requests = (cfg.requests_per_s, cfg.request_burst or max(1.0, 2 * cfg.requests_per_s)) \
        if cfg.requests_per_s else None
    tokens_per_s = cfg.tokens_per_min / 60 if cfg.tokens_per_min else None
    tokens = (tokens_per_s, cfg.token_burst or 10 * tokens_per_s) if tokens_per_s else None
    return tuple(None if b is None else (b[0] / share, b[1] / share) for b in (requests, tokens))  # type: ignore[return-value]


class TenantRateLimiter:
    """Request and token buckets for one tenant; either may be absent (unlimited)."""

    def __init__(self, cfg: RateLimit, now: float, share: int = 1) -> None:
        requests, tokens = buckets(cfg, share)
        self.requests = TokenBucket(*requests, now) if requests else None
        self.tokens = TokenBucket(*tokens, now) if tokens else None

    def take(self, tokens: int, now: float) -> tuple[Reason, float] | None:
        """None if the request may pass (and is charged); else (reason, retry_after)."""
        if self.requests is not None:
            wait = self.requests.wait_time(1, now)
            if wait > 0:
                return Reason.RATE_LIMITED_REQUESTS, wait
        if self.tokens is not None:
            wait = self.tokens.wait_time(tokens, now)
            if wait > 0:
                return Reason.RATE_LIMITED_TOKENS, wait
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            self.tokens.take(tokens, now)
        return None

    def blocked(self, now: float) -> tuple[Reason, float] | None:
        """What `take` would refuse any request with, without charging: its request bucket
        empty, or its token bucket without a single token; else None."""
        if self.requests is not None and (wait := self.requests.wait_time(1, now)) > 0:
            return Reason.RATE_LIMITED_REQUESTS, wait
        if self.tokens is not None and (wait := self.tokens.wait_time(1, now)) > 0:
            return Reason.RATE_LIMITED_TOKENS, wait
        return None

    def refund(self, tokens: int, now: float) -> None:
        if self.requests is not None:
            self.requests.give_back(1, now)
        if self.tokens is not None:
            self.tokens.give_back(tokens, now)

    def settle(self, charged: int, used: int, now: float) -> None:
        """A request charged `charged` tokens used `used`: the difference given back or taken
        (each as its bucket counted it, at most a burst), the request bucket untouched."""
        b = self.tokens
        if b is not None:
            diff = min(charged, b.burst) - min(used, b.burst)
            if diff > 0:
                b.give_back(diff, now)
            elif diff < 0:
                b.take(-diff, now)

    def headroom(self, now: float) -> tuple[tuple[float, float, float] | None, tuple[float, float, float] | None]:
        """(level, burst, rate) of its request and token buckets (None where it has no such limit)."""
        out = []
        for bucket in (self.requests, self.tokens):
            if bucket is None:
                out.append(None)
            else:
                bucket.wait_time(0, now)  # refilled to now
                out.append((bucket.level, bucket.burst, bucket.rate))
        return out[0], out[1]


class RateLimitStore(Protocol):
    """Tenants' rate-limit buckets. Contract: `take` is atomic (it charges only when it lets the
    request pass); `refund` of a charge taken earlier makes the tenant's budget as if that
    request had not come (up to the bucket's burst); `settle` gives back the tokens a served
    request was charged and did not use, or takes those it used beyond them; `blocked` says,
    charging nothing, whether `take` would now refuse any request of the tenant, however small;
    `headroom` is what the tenant's buckets hold, as best this gateway knows; `configure` with
    a tenant's limits starts its buckets full, and is a no-op for limits it already has."""

    def configure(self, tenant: str, limits: RateLimit, now: float) -> None: ...
    def take(self, tenant: str, tokens: int, now: float) -> tuple[Reason, float] | None: ...
    def blocked(self, tenant: str, now: float) -> tuple[Reason, float] | None: ...
    def refund(self, tenant: str, tokens: int, now: float) -> None: ...
    def settle(self, tenant: str, charged: int, used: int, now: float) -> None: ...
    def headroom(self, tenant: str, now: float) -> tuple[tuple[float, float, float] | None,
                                                         tuple[float, float, float] | None]: ...


class LocalRateLimits:
    """The buckets of this process's tenants."""

    def __init__(self) -> None:
        self._limiters: dict[str, tuple[RateLimit, TenantRateLimiter]] = {}

    def configure(self, tenant: str, limits: RateLimit, now: float) -> None:
        current = self._limiters.get(tenant)
        if current is None or current[0] != limits:
            self._limiters[tenant] = (limits, TenantRateLimiter(limits, now))

    def take(self, tenant: str, tokens: int, now: float) -> tuple[Reason, float] | None:
        return self._limiters[tenant][1].take(tokens, now)

    def blocked(self, tenant: str, now: float) -> tuple[Reason, float] | None:
        return self._limiters[tenant][1].blocked(now)

    def refund(self, tenant: str, tokens: int, now: float) -> None:
        self._limiters[tenant][1].refund(tokens, now)

    def settle(self, tenant: str, charged: int, used: int, now: float) -> None:
        current = self._limiters.get(tenant)
        if current is not None:  # (a tenant a reload removed has no buckets)
            current[1].settle(charged, used, now)

    def headroom(self, tenant: str, now: float) -> tuple[tuple[float, float, float] | None,
                                                         tuple[float, float, float] | None]:
        current = self._limiters.get(tenant)
        return current[1].headroom(now) if current is not None else (None, None)
