"""The state the core's decisions read and write, behind small store interfaces.

The decisions stay in the pure core; where their state lives is a choice of `Stores`: in this
process (`Stores.local()`, the default), or in a store several gateways share, which implements
the same interfaces. Each interface states its contract in its own module, and every
implementation passes the same suite (tests/conformance/test_stores.py):
- `permits`: admitted requests in flight and what they hold on their replicas (`permits.py`);
- `rate_limits`: tenants' request and token buckets (`rate_limit.py`);
- `credit`: fair-share credit per model, band and tenant (`fairness.py`);
- `retries`: first attempts, for a retry to keep its first deadline (`retries.py`);
- `backlog`: dispatch, departure and completion times, for wait estimates (`backlog.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bouncer.core.fleet.permits import LocalPermits, PermitStore
from bouncer.core.flow.backlog import BacklogStore, LocalBacklog
from bouncer.core.flow.fairness import CreditStore, LocalCredit
from bouncer.core.intake.rate_limit import LocalRateLimits, RateLimitStore
from bouncer.core.intake.retries import RetryLedger, RetryStore


@dataclass(frozen=True)
class Stores:
    permits: PermitStore
    rate_limits: RateLimitStore
    credit: CreditStore
    retries: RetryStore
    backlog: BacklogStore

    @classmethod
    def local(cls, remember_s: float = 120.0, max_remembered: int = 100_000) -> Stores:
        return cls(LocalPermits(), LocalRateLimits(), LocalCredit(), RetryLedger(remember_s, max_remembered),
                   LocalBacklog())
