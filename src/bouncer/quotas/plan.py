"""Which limits a request is charged against, and how much: from the config, pure.

A tenant's limits are its own (`Tenant.quota.limits`) and those of each group it is in
(`quotas.groups`). Each limit is kept per window under its own key; a request's charge on it is
its tokens (prompt, completion or both) or their price (the model's, or the overflow target's
that served it).
"""

from __future__ import annotations

from typing import NamedTuple

from bouncer.config import BouncerConfig
from bouncer.core.requests import OverQuota
from bouncer.quotas.settings import Price, QuotaLimit
from bouncer.quotas.windows import Window, window_at


class Line(NamedTuple):
    """One limit as it applies to a tenant: its own, or a group's."""

    scope: str  # "tenant", or the group's level (org, team)
    owner: str  # the tenant's or the group's name
    limit: QuotaLimit
    time_zone: str

    def describe(self, window: Window) -> str:
        return (f"{self.scope} {self.owner}: {self.limit.limit:g} {self.limit.unit} per {self.limit.window} "
                f"({window.label} {self.time_zone})")


class Charge(NamedTuple):
    """A request's part on one line, in the window it was admitted in."""

    key: str
    line: Line
    window: Window
    amount: float


def amount(unit: str, prompt_tokens: float, completion_tokens: float, price: Price | None) -> float:
    if unit == "prompt_tokens":
        return float(prompt_tokens)
    if unit == "completion_tokens":
        return float(completion_tokens)
    if unit == "total_tokens":
        return float(prompt_tokens + completion_tokens)
    return price.cost(prompt_tokens, completion_tokens) if price is not None else 0.0


class QuotaPlan:
    """The config's limits by tenant, and what each tenant's requests get past them."""

    def __init__(self, config: BouncerConfig) -> None:
        q = config.quotas
        self.key_prefix = (q.key_prefix if q is not None else "bouncer:") + "quota:"
        zone = q.time_zone if q is not None else "UTC"
        self.lines: dict[str, list[Line]] = {t.name: [] for t in config.tenants}
        self.over: dict[str, tuple[str, int]] = {}
        for t in config.tenants:
            if t.quota is not None:
                self.lines[t.name] += [Line("tenant", t.name, lim, lim.time_zone or zone) for lim in t.quota.limits]
                self.over[t.name] = (t.quota.over, t.quota.demote_band)
        self.groups: dict[tuple[str, str], list[Line]] = {}
        for g in q.groups if q is not None else []:
            lines = [Line(g.level, g.name, lim, lim.time_zone or zone) for lim in g.limits]
            self.groups[(g.level, g.name)] = lines
            for name in g.tenants:
                self.lines[name] += lines
        self.prices = {m.name: m.price for m in config.models}
        self.overflow_prices = {(m.name, o.name): o.price or (self.prices[o.model] if o.model else m.price)
                                for m in config.models for o in m.overflow}

    def applies(self, tenant: str) -> bool:
        return bool(self.lines.get(tenant))

    def key(self, line: Line, window: Window) -> str:
        return (f"{self.key_prefix}{line.scope}:{line.owner}:{line.limit.unit}:{line.limit.window}:"
                f"{line.time_zone}:{window.label}")

    def charges(self, lines: list[Line], prompt_tokens: float, completion_tokens: float, price: Price | None,
                at: float) -> list[Charge]:
        """What a request of these sizes costs on each line, in the windows `at` falls in."""
        out = []
        for line in lines:
            window = window_at(line.limit.window, line.time_zone, at)
            out.append(Charge(self.key(line, window), line, window,
                              amount(line.limit.unit, prompt_tokens, completion_tokens, price)))
        return out

    def price(self, model: str, overflow_target: str | None = None) -> Price | None:
        """The price its tokens are counted at: the model's, or the overflow target's that served it."""
        if overflow_target is not None:
            return self.overflow_prices.get((model, overflow_target), self.prices.get(model))
        return self.prices.get(model)

    def verdict(self, tenant: str, spent: list[Charge], at: float) -> OverQuota:
        """What its requests get while `spent` (the lines with no room) are: its `over` choice
        (refuse where it states none), until the last of them resets."""
        action, band = self.over.get(tenant, ("refuse", -1))
        last = max(spent, key=lambda c: c.window.end)
        return OverQuota(action, band, max(0.0, last.window.end - at), last.line.describe(last.window))
