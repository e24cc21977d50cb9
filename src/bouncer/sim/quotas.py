"""Quotas and overflow in the simulator, as the gateway keeps them: the same book
(`bouncer.quotas.book`) over an in-process ledger, on simulated time (`epoch`: the wall-clock
time of simulated second 0, so calendar windows fall where a scenario wants them). What is
reserved and settled when is the journey's (`bouncer.core.journey`), as in the gateway."""

from __future__ import annotations

import math

from bouncer.config import BouncerConfig
from bouncer.core.requests import OverQuota
from bouncer.quotas.book import QuotaBook
from bouncer.quotas.ledger import LocalQuotaLedger


class SimQuotas:
    def __init__(self, config: BouncerConfig, epoch: float) -> None:
        self.book = QuotaBook(config)
        self.ledger = LocalQuotaLedger()
        self.epoch = epoch
        self.first_over: dict[str, float] = {}  # tenant -> when a request of it first found its quota spent
        self.over: set[str] = set()  # attempts that found it spent

    def reserve(self, rid: str, tenant: str, model: str, prompt_tokens: int, predicted_output: int,
                now: float) -> OverQuota | None:
        if not self.book.applies(tenant):
            return None
        at = self.epoch + now
        asked = self.book.ask(tenant, model, prompt_tokens, predicted_output, at)
        full = self.ledger.reserve(rid, asked.holds, asked.force, math.inf, at)  # no gateway dies here
        if full:
            self.first_over.setdefault(tenant, now)
            self.over.add(rid)
        return self.book.answered(rid, asked, full, at)

    def settle(self, rid: str, prompt_tokens: int, completion_tokens: int | None,
               overflow_target: str | None = None) -> None:
        """As `QuotaKeeper.settle`, at once."""
        used = self.book.used(rid, prompt_tokens, completion_tokens, overflow_target)
        if used is not None:
            self.ledger.settle(rid, [(key, amount) for key, amount, _ in used])

    def spent(self, at: float) -> dict[str, float]:
        """Each line's spend in its window at simulated time `at`, by key."""
        lines = self.book.current(self.epoch + at)
        return {c.key: level.spent for c, level in zip(lines, self.ledger.levels([c.key for c in lines]), strict=True)}
