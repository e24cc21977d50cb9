"""What a quota keeper does for each request, apart from where the spend lives: the holds a
request reserves, what its tenant gets when they do not fit, and what it used when it ends. The
gateway's keeper (`bouncer.gateway.quota_keeper`, Redis) and the simulator's (`bouncer.sim.quotas`,
in-process) both keep their requests here, so the two count the same way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from bouncer.config import BouncerConfig
from bouncer.core.requests import OverQuota
from bouncer.quotas.ledger import Hold, Level
from bouncer.quotas.plan import Charge, QuotaPlan

KEPT_AFTER_WINDOW_S = 40 * 86400  # a window's spend stays readable this long after it ends


@dataclass(slots=True)
class Held:
    """A request with a reservation (or, `reserved` False, one admitted while the store was away)."""

    model: str
    charges: list[Charge]  # its lines, in the windows it was admitted in
    reserved: bool


@dataclass(slots=True)
class Asked:
    """A reservation to make: its holds, and whether it is made even where they do not fit."""

    tenant: str
    model: str
    charges: list[Charge]
    holds: list[Hold]
    force: bool  # its tenant is demoted or diverted past its quota: still served, its spend still counts


class QuotaBook:
    def __init__(self, config: BouncerConfig) -> None:
        self.held: dict[str, Held] = {}
        self.shadow_over: Counter[str] = Counter()  # line key -> requests that found its shadow limit spent
        self.reconfigure(config)

    def reconfigure(self, config: BouncerConfig) -> None:
        self.plan = QuotaPlan(config)

    def applies(self, tenant: str) -> bool:
        return self.plan.applies(tenant)

    def ask(self, tenant: str, model: str, prompt_tokens: int, predicted_output: int, at: float) -> Asked:
        """The reservation a request of these sizes asks for at `at` (seconds since the epoch)."""
        price = self.plan.price(model)
        charges = self.plan.charges(self.plan.lines[tenant], prompt_tokens, predicted_output, price, at)
        holds = [Hold(c.key, c.line.limit.limit, c.amount, c.window.end + KEPT_AFTER_WINDOW_S, not c.line.limit.shadow)
                 for c in charges]
        return Asked(tenant, model, charges, holds, self.plan.over.get(tenant, ("refuse", 0))[0] != "refuse")

    def answered(self, rid: str, asked: Asked, full: list[int], at: float) -> OverQuota | None:
        """The store's answer (the lines without room): what its tenant's requests get, None
        where it fits (a shadow line without room is counted in `shadow_over`, never in its way);
        a reservation made is kept under `rid` for `used`."""
        spent = [asked.charges[i] for i in full if not asked.charges[i].line.limit.shadow]
        for i in full:
            if asked.charges[i].line.limit.shadow:
                self.shadow_over[asked.charges[i].key] += 1
        if not spent or asked.force:
            self.held[rid] = Held(asked.model, asked.charges, reserved=True)
        return self.plan.verdict(asked.tenant, spent, at) if spent else None

    def unreserved(self, rid: str, asked: Asked) -> None:
        """Admitted without a reservation (the store away, fail-open): its spend is still settled."""
        self.held[rid] = Held(asked.model, asked.charges, reserved=False)

    def used(self, rid: str, prompt_tokens: int, completion_tokens: int | None,
             overflow_target: str | None = None) -> list[tuple[str, float, float]] | None:
        """What `rid` used on each of its lines, (key, amount, expire_at), at the price of whoever
        served it; None where it holds nothing to settle. It leaves the book. `completion_tokens`
        None: its answer was not seen (an endpoint picker let it pass), and what it reserved
        (prompt and predicted output) is what it is charged."""
        held = self.held.pop(rid, None)
        if held is None:
            return None
        if completion_tokens is None:
            return [(c.key, c.amount, c.window.end + KEPT_AFTER_WINDOW_S) for c in held.charges]
        price = self.plan.price(held.model, overflow_target)
        used = [(c.key, self.plan.charges([c.line], prompt_tokens, completion_tokens, price, c.window.start)[0].amount,
                 c.window.end + KEPT_AFTER_WINDOW_S) for c in held.charges]
        if not held.reserved and not any(a for _, a, _ in used):
            return None  # nothing reserved, nothing used
        return used

    def current(self, at: float, tenant: str | None = None) -> list[Charge]:
        """Every line in force (or `tenant`'s: its own and its groups'), in its window at `at`
        (each group's once), amounts 0."""
        seen, out = set(), []
        for lines in [self.plan.lines[tenant]] if tenant is not None else self.plan.lines.values():
            for c in self.plan.charges(lines, 0, 0, None, at):
                if c.key not in seen:
                    seen.add(c.key)
                    out.append(c)
        return out

    def row(self, c: Charge, level: Level) -> dict:
        """One line as reported (`/admin/state`, metrics, `bouncer quota show`)."""
        limit = c.line.limit
        return {"scope": c.line.scope, "owner": c.line.owner, "unit": limit.unit, "window": limit.window,
                "shadow": limit.shadow,
                "period": c.window.label, "time_zone": c.line.time_zone, "limit": limit.limit, "spent": level.spent,
                "reserved": level.reserved, "remaining": max(0.0, limit.limit - level.spent - level.reserved),
                "resets_at": c.window.end, "shadow_over": self.shadow_over.get(c.key, 0)}
