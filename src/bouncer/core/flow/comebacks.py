"""When a refused tenant next gets in: what a refusal's Retry-After says.

A client told to come back after Retry-After sends its next request then; what it needs to know
is when a request of its tenant, sent from now on, is next let through. So each tenant's recent
refusals are followed until that happens: a refusal at `r` is answered by the first dispatch of a
request of the tenant sent at `r` or later, and `now - r` is how long it took (its *lag*).
Retry-After is the mean lag of the tenant's refusals answered over the last `WINDOW_S`.
Answered in time order, those are a fair sample of its refusals' lags: one that took long is
counted when it is answered, as one that took little is.

Estimated instead from the backlog ahead over the rate the waiting room turns over (what
Retry-After said before, and still says where a tenant has too few answered refusals), the
median Retry-After was 0.03x the lag on ServeGen's m-large pool at load 2, where the room turned
over fast by refusals while one heavy tenant waited tens of seconds, and 2.6-3.2x it on m-mid;
from each tenant's dispatch rate and its dispatched requests' mean wait, 4.2x in `fairness` (the
first of a tenant's later requests to get in waits far less than the mean) and 0.26-0.35x on
DeepSeek-R1 (issue 51; `retry_after_accuracy` in `bench run` measures the ratio).

A tenant whose refused requests have waited `WINDOW_S` or more, none answered lately, is
starved for now: it is told how long they have waited so far (`Backlog.retry_after` caps it).

A tenant of one client that retries on every refusal answers its refusals with its own retries,
so their lags include the Retry-After it was given: the estimate grows by a wait each round,
until its refusals answered in the window are too few (`MIN_ANSWERED`) and the backlog's
estimate is used again.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 10.0  # refusals answered over this long make the estimate
MIN_ANSWERED = 3  # fewer: no estimate
THIN_S = 0.01  # refusals of a tenant closer than this to the last one followed are not followed
MAX_FOLLOWED = 4096  # refusals of one tenant followed at once (the oldest kept: a starved tenant's)


class _Tenant:
    __slots__ = ("waiting", "answered", "lag_sum")

    def __init__(self) -> None:
        self.waiting: deque[float] = deque()  # refusals not yet answered, oldest first
        self.answered: deque[tuple[float, float]] = deque()  # (answered at, lag), over the window
        self.lag_sum = 0.0


class Comebacks:
    """Each tenant's refusals and how long they took to be answered (of one model, at this gateway)."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}

    def refused(self, tenant: str, now: float) -> float | None:
        """A request of `tenant` is refused now (followed until answered). Returns the seconds
        until one of its requests sent from now on is expected to get in: the mean lag of its
        refusals answered lately, or how long its refusals have waited unanswered where that is
        `WINDOW_S` or more and none were answered lately; None with neither."""
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant()
        answered = t.answered
        while answered and answered[0][0] < now - WINDOW_S:
            t.lag_sum -= answered.popleft()[1]
        estimate = None
        if len(answered) >= MIN_ANSWERED:
            estimate = t.lag_sum / len(answered)
        elif t.waiting and now - t.waiting[0] >= WINDOW_S:
            estimate = now - t.waiting[0]
        waiting = t.waiting
        if len(waiting) < MAX_FOLLOWED and (not waiting or now - waiting[-1] >= THIN_S):
            waiting.append(now)
        return estimate

    def dispatched(self, tenant: str, sent_at: float, now: float) -> None:
        """A request of `tenant` sent at `sent_at` is dispatched now: it answers the refusals
        before it."""
        t = self._tenants.get(tenant)
        if t is None:
            return
        waiting = t.waiting
        while waiting and waiting[0] <= sent_at:
            lag = now - waiting.popleft()
            t.answered.append((now, lag))
            t.lag_sum += lag
