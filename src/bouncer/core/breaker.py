"""A per-tenant circuit breaker: closed, open, half-open.

It trips on failures that hurt the shared fleet: upstream timeouts and runaway sequences that
ran into the context limit. While open, the tenant's requests are refused at once (cheap) for
`open_s`; then one probe is let through (half-open), and its outcome closes or re-opens it.
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
        self._probe_out = False

    def allow(self, now: float) -> float | None:
        """None if a request may pass; else seconds until the breaker will let one through."""
        if self.state is BreakerState.OPEN:
            remaining = self._opened_at + self.open_s - now
            if remaining > 0:
                return remaining
            self.state = BreakerState.HALF_OPEN
            self._probe_out = False
        if self.state is BreakerState.HALF_OPEN:
            if self._probe_out:
                return self.open_s
            self._probe_out = True
        return None

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
        if len(self._failures) >= self.threshold:
            self._trip(now)

    def _trip(self, now: float) -> None:
        self.state = BreakerState.OPEN
        self._opened_at = now
        self._failures.clear()
