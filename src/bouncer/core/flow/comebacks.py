"""When a refused tenant next gets in: what a refusal's Retry-After says.

A client told to come back after Retry-After sends its next request then; what it needs to know
is when a request of its tenant, sent from now on, is next let through. So each tenant's recent
refusals are followed until that happens: a refusal at `r` is answered by the first dispatch of a
request of the tenant sent at `r` or later, and `now - r` is how long it took (its *lag*).
Retry-After is the median of the lags of the tenant's refusals answered over the last `WINDOW_S`
and of what those not answered yet are expected to wait: twice how long they have waited so
far. Answered in time order, the first are a fair sample of its refusals' lags while the lags
hold still; the second keep the estimate from trailing them when they grow (a tenant refused in
a burst whose earlier refusals were answered quickly, or one starved: its refusals wait,
unanswered, and the estimate grows with them; `Backlog.retry_after` caps it).

- **The median, not the mean**: lags are skewed (most refusals of a busy tenant are answered by
  its next admission soon after; a few wait through a long stretch without one), and the mean
  follows the few, where the client wants the typical wait.
- **Twice the wait so far**: a refusal still waiting after `w` has a lag of at least `w`, and
  with nothing known of how long the stretch it waits in lasts, the even guess is that it is as
  likely to be over before `2w` as after; counted at `w` (its least), a tenant entering a
  starved stretch is told a fraction of it.

Retry-After was estimated other ways before (the backlog ahead over the rate the waiting room
turns over, which it still is where a tenant has too few refusals followed; each tenant's
dispatch rate and mean wait; answered refusals alone; the mean of lags): each was off by 3x or
more on some pool. What each gave against the lags, on which runs, and with which seeds held out
while choosing, is in docs/benchmarks/retry-after.md (`retry_after_accuracy` in `bench run`
measures it).

A tenant of one client that retries on every refusal answers its refusals with its own retries,
so their lags include the Retry-After it was given: the estimate grows by a wait each round,
until its refusals followed in the window are too few (`MIN_FOLLOWED`) and the backlog's
estimate is used again.
"""

from __future__ import annotations

import bisect
from collections import deque

WINDOW_S = 10.0  # refusals answered over this long make the estimate, with those not answered yet
MIN_FOLLOWED = 3  # fewer of those: no estimate
THIN_S = 0.01  # refusals of a tenant closer than this to the last one followed are not followed
MAX_FOLLOWED = 4096  # refusals of one tenant followed at once (the oldest kept: a starved tenant's)
INF = float("inf")


class _Tenant:
    __slots__ = ("waiting", "answered", "lags")

    def __init__(self) -> None:
        self.waiting: deque[float] = deque()  # refusals not yet answered, oldest first
        self.answered: deque[tuple[float, float]] = deque()  # (answered at, lag), over the window
        self.lags: list[float] = []  # the same lags, sorted

    def median_lag(self, now: float) -> float:
        """The median of the answered lags and of the waiting refusals' expected lags, twice their
        waits so far (`now` less the refusal times: `waiting` read from its newest is them in
        order). The usual selection in two sorted sequences: how many of the lower half come
        from the answered lags is found by bisection."""
        lags, waiting = self.lags, self.waiting
        m = len(waiting)
        n = len(lags) + m
        k = (n - 1) // 2  # the lower middle, from 0
        lo, hi = max(0, k + 1 - m), min(k + 1, len(lags))
        while lo < hi:
            i = (lo + hi) // 2  # taking i answered lags and k + 1 - i waiting ones
            if lags[i] < 2 * (now - waiting[m - 1 - (k - i)]):
                lo = i + 1
            else:
                hi = i
        i, j = lo, k + 1 - lo
        lower = max(lags[i - 1] if i else -INF, 2 * (now - waiting[m - j]) if j else -INF)
        if n % 2:
            return lower
        upper = min(lags[i] if i < len(lags) else INF, 2 * (now - waiting[m - 1 - j]) if j < m else INF)
        return (lower + upper) / 2


class Comebacks:
    """Each tenant's refusals and how long they took to be answered (of one model, at this gateway)."""

    def __init__(self) -> None:
        self._tenants: dict[str, _Tenant] = {}

    def refused(self, tenant: str, now: float) -> float | None:
        """A request of `tenant` is refused now (followed until answered). Returns the seconds
        until one of its requests sent from now on is expected to get in: the median lag of its
        refusals answered lately and of those not answered yet (twice how long they have waited
        so far); None with fewer than `MIN_FOLLOWED` of them."""
        t = self._tenants.get(tenant)
        if t is None:
            t = self._tenants[tenant] = _Tenant()
        answered, waiting = t.answered, t.waiting
        while answered and answered[0][0] < now - WINDOW_S:
            lag = answered.popleft()[1]
            del t.lags[bisect.bisect_left(t.lags, lag)]
        estimate = t.median_lag(now) if len(answered) + len(waiting) >= MIN_FOLLOWED else None
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
            bisect.insort(t.lags, lag)
