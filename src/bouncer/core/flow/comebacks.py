"""When a refused tenant next gets in: what a refusal's Retry-After says.

A client told to come back after Retry-After sends its next request then; what it needs to know
is when a request of its tenant, sent from now on, is next let through. So each tenant's recent
refusals are followed until that happens: a refusal at `r` is answered by the first dispatch of a
request of the tenant sent at `r` or later, and `now - r` is how long it took (its *lag*).
Retry-After is the mean lag of the tenant's refusals answered over the last `WINDOW_S` and of
those not answered yet, counted at how long they have waited so far. Answered in time order,
the first are a fair sample of its refusals' lags while the lags hold still; the second keep the
estimate from trailing them when they grow (a tenant refused in a burst whose earlier refusals
were answered quickly, or one starved: its refusals wait, unanswered, and the estimate grows
with them; `Backlog.retry_after` caps it).

Estimated instead from the backlog ahead over the rate the waiting room turns over (what
Retry-After said before, and still says where a tenant has too few refusals followed), the
median Retry-After was 0.03x the lag on ServeGen's m-large pool at load 2, where the room turned
over fast by refusals while one heavy tenant waited tens of seconds, and 2.6-3.2x it on m-mid;
from each tenant's dispatch rate and its dispatched requests' mean wait, 4.2x in `fairness` (the
first of a tenant's later requests to get in waits far less than the mean) and 0.26-0.35x on
DeepSeek-R1; from answered refusals alone, 0.28-0.30x on DeepSeek-R1 at load 3 (issue 51;
`retry_after_accuracy` in `bench run` measures the ratio).

A tenant of one client that retries on every refusal answers its refusals with its own retries,
so their lags include the Retry-After it was given: the estimate grows by a wait each round,
until its refusals followed in the window are too few (`MIN_FOLLOWED`) and the backlog's
estimate is used again.
"""

from __future__ import annotations

from collections import deque

WINDOW_S = 10.0  # refusals answered over this long make the estimate, with those not answered yet
MIN_FOLLOWED = 3  # fewer of those: no estimate
THIN_S = 0.01  # refusals of a tenant closer than this to the last one followed are not followed
MAX_FOLLOWED = 4096  # refusals of one tenant followed at once (the oldest kept: a starved tenant's)


class _Tenant:
    __slots__ = ("waiting", "waiting_sum", "answered", "lag_sum")

    def __init__(self) -> None:
        self.waiting: deque[float] = deque()  # refusals not yet answered, oldest first
        self.waiting_sum = 0.0  # their times, summed
        self.answered: deque[tuple[float, float]] = deque()  # (answered at, lag), over the window
        self.lag_sum = 0.0


class Comebacks:
    """Each tenant's refusals and how long they took to be answered (of one model, at this gateway)."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}

    def refused(self, tenant: str, now: float) -> float | None:
        """A request of `tenant` is refused now (followed until answered). Returns the seconds
        until one of its requests sent from now on is expected to get in: the mean lag of its
        refusals answered lately and of those not answered yet (how long they have waited so
        far); None with fewer than `MIN_FOLLOWED` of them."""
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant()
        answered, waiting = t.answered, t.waiting
        while answered and answered[0][0] < now - WINDOW_S:
            t.lag_sum -= answered.popleft()[1]
        count = len(answered) + len(waiting)
        estimate = None
        if count >= MIN_FOLLOWED:
            estimate = (t.lag_sum + len(waiting) * now - t.waiting_sum) / count
        if len(waiting) < MAX_FOLLOWED and (not waiting or now - waiting[-1] >= THIN_S):
            waiting.append(now)
            t.waiting_sum += now
        return estimate

    def dispatched(self, tenant: str, sent_at: float, now: float) -> None:
        """A request of `tenant` sent at `sent_at` is dispatched now: it answers the refusals
        before it."""
        t = self._tenants.get(tenant)
        if t is None:
            return
        waiting = t.waiting
        while waiting and waiting[0] <= sent_at:
            refused_at = waiting.popleft()
            t.waiting_sum -= refused_at
            lag = now - refused_at
            t.answered.append((now, lag))
            t.lag_sum += lag
