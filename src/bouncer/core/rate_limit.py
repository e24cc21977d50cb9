"""Per-tenant token buckets, with time passed in.

A bucket holds up to `burst` units and refills at `rate` units per second. Taking more than it
holds is refused with the time until it would hold enough: that is the Retry-After.
"""

from __future__ import annotations


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


class TenantRateLimiter:
    """Request and token buckets for one tenant; either may be absent (unlimited)."""

    def __init__(self, requests_per_s: float | None, request_burst: int | None,
                 tokens_per_min: float | None, token_burst: int | None, now: float) -> None:
        self.requests = TokenBucket(requests_per_s, request_burst or max(1.0, 2 * requests_per_s), now) \
            if requests_per_s else None
        tokens_per_s = tokens_per_min / 60 if tokens_per_min else None
        self.tokens = TokenBucket(tokens_per_s, token_burst or 10 * tokens_per_s, now) if tokens_per_s else None

    def check(self, tokens: int, now: float) -> tuple[str, float] | None:
        """None if the request may pass (and is charged); else (reason, retry_after)."""
        if self.requests is not None:
            wait = self.requests.wait_time(1, now)
            if wait > 0:
                return "rate_limited_requests", wait
        if self.tokens is not None:
            wait = self.tokens.wait_time(tokens, now)
            if wait > 0:
                return "rate_limited_tokens", wait
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            self.tokens.take(tokens, now)
        return None
