"""A per-tenant circuit breaker: closed, open, half-open.

It trips on failures that hurt the shared fleet: upstream timeouts and runaway sequences that
ran into the context limit. While open, the tenant's requests are refused at once (cheap) for
`open_s`; then one probe is let through (half-open), and its outcome closes or re-opens it. A
probe that ends with neither (refused by a later layer, expired, cancelled) gives its turn back
(`release_probe`, the core's finaliser calls it), so the next request probes instead; and a probe
out for longer than `open_s` without news is given up on the same way, so no lost probe can keep
the tenant out for ever.

With several gateways sharing state, each keeps its own breaker per tenant and tells the others
what it holds (`share`): how long it refuses the tenant, and its failures in the window. A
gateway refuses a tenant while any gateway's breaker holds it (one failing tenant is paused
fleet-wide, not on one gateway in N), and trips on the failures of all of them together (N
gateways seeing `failures - 1` each is the tenant failing N times over). Each reports only its
own state, so an open breaker is not echoed back and forth; when it half-opens, each gateway may
send one probe.
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(self, failures: int, window_s: float, open_s: float) -> None:
        self.threshold = failures
        self.window_s = window_s
        self.open_s = open_s
        self.state = BreakerState.CLOSED
        self._failures: deque[float] = deque()
        self._opened_at = 0.0
        self._probe_since: float | None = None  # when the half-open probe went out
        self._elsewhere_until = float("-inf")  # another gateway's breaker holds the tenant until then
        self._elsewhere_failures = 0  # the others' failures in their windows, as last seen

    def allow(self, now: float) -> tuple[float | None, bool]:
        """(None if a request may pass, else seconds until the breaker will let one through;
        whether the request that passes is the half-open probe)."""
        if now < self._elsewhere_until:
            return self._elsewhere_until - now, False
        if self.state is BreakerState.OPEN:
            remaining = self._opened_at + self.open_s - now
            if remaining > 0:
                return remaining, False
            self.state = BreakerState.HALF_OPEN
            self._probe_since = None
        if self.state is BreakerState.HALF_OPEN:
            if self._probe_since is not None and now - self._probe_since < self.open_s:
                return self._probe_since + self.open_s - now, False
            self._probe_since = now
            return None, True
        return None, False

    def wait(self, now: float) -> float | None:
        """What `allow` would refuse with, without taking anything: seconds until a request may
        pass, or None."""
        if now < self._elsewhere_until:
            return self._elsewhere_until - now
        return self._own_wait(now)

    def _own_wait(self, now: float) -> float | None:
        if self.state is BreakerState.OPEN:
            remaining = self._opened_at + self.open_s - now
            if remaining > 0:
                return remaining
            return None  # it would turn half-open and let this one probe
        if self.state is BreakerState.HALF_OPEN and self._probe_since is not None and \
                now - self._probe_since < self.open_s:
            return self._probe_since + self.open_s - now
        return None

    def release_probe(self) -> None:
        """The probe ended without telling success from failure: the next request probes."""
        if self.state is BreakerState.HALF_OPEN:
            self._probe_since = None

    def record_success(self, now: float) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.state = BreakerState.CLOSED
            self._failures.clear()

    def record_failure(self, now: float) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self._trip(now)
            return
        self._failures.append(now)
        while self._failures and self._failures[0] <= now - self.window_s:
            self._failures.popleft()
        if len(self._failures) + self._elsewhere_failures >= self.threshold:
            self._trip(now)

    def _trip(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = now
        self._failures.clear()

    # -- several gateways ---------------------------------------------------------------------------
    def share(self, now: float) -> tuple[float | None, int]:
        """What this gateway's own breaker says, for the others: seconds it refuses the tenant
        (None: it lets requests through), and its failures in the window."""
        while self._failures and self._failures[0] <= now - self.window_s:
            self._failures.popleft()
        return self._own_wait(now), len(self._failures)

    def seen_elsewhere(self, wait: float | None, failures: int, now: float) -> None:
        """The others' breakers for this tenant: the longest any refuses it for, their failures."""
        self._elsewhere_until = float("-inf") if wait is None else now + wait
        self._elsewhere_failures = failures
