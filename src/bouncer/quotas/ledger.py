"""The reservation rules, and a ledger that keeps them in this process (the simulator, tests).
The gateways keep the same rules in Redis (`bouncer.gateway.quota_store`, Lua scripts), and the
tests hold both to them.

Per limit and window a key holds what was `spent` (settled) and what is `reserved` (admitted,
not yet settled). A request:
- `reserve`: on every line at once or on none. A line has room when spent + reserved + the
  request's amount is within its limit; where a line that `blocks` has none it reserves on none,
  unless `force` (a tenant that is demoted or diverted past its quota: it is still served, so its
  spend still counts). A line that does not block (a shadow limit) is counted, never in the way.
  Returns the lines without room. Its reservation has a lease;
- `settle`: its reservation goes, and what it used is spent (in the windows it was admitted in).
  A reservation already given back (its lease ran out) only adds the spend;
- `renew`: its gateway still holds it. A reservation not renewed within its lease (its gateway
  died) is given back at the next `reserve` or `renew` of any gateway, so a lost one holds no
  room for longer than that. A settle sent twice counts once.
"""

from __future__ import annotations

from typing import NamedTuple


class Hold(NamedTuple):
    """One line of a reservation: the key, its limit, the amount, and when the key may be dropped."""

    key: str
    limit: float
    amount: float
    expire_at: float  # seconds since the epoch: the window's end, plus the time its spend stays readable
    blocks: bool = True  # a line without room keeps the request from reserving (False: a shadow limit)


class Level(NamedTuple):
    spent: float
    reserved: float


class LocalQuotaLedger:
    def __init__(self) -> None:
        self._levels: dict[str, list[float]] = {}  # key -> [spent, reserved]
        self._held: dict[str, tuple[list[tuple[str, float]], float]] = {}  # rid -> lines held, lease end
        self._settled: set[str] = set()  # a settle sent twice counts once

    def reserve(self, rid: str, holds: list[Hold], force: bool, lease_s: float, now: float) -> list[int]:
        self._sweep(now)
        full = [i for i, h in enumerate(holds)
                if sum(self._levels.get(h.key, (0.0, 0.0))) + h.amount > h.limit]
        if any(holds[i].blocks for i in full) and not force:
            return full
        for h in holds:
            self._levels.setdefault(h.key, [0.0, 0.0])[1] += h.amount
        self._held[rid] = ([(h.key, h.amount) for h in holds], now + lease_s)
        return full

    def settle(self, rid: str, used: list[tuple[str, float]]) -> bool:
        """False: `rid` was settled already (nothing changes)."""
        if rid in self._settled:
            return False
        self._settled.add(rid)
        held, _ = self._held.pop(rid, ([], 0.0))
        for key, amount in held:
            self._levels[key][1] -= amount
        for key, amount in used:
            self._levels.setdefault(key, [0.0, 0.0])[0] += amount
        return True

    def renew(self, rids: list[str], lease_s: float, now: float) -> None:
        self._sweep(now)
        for rid in rids:
            if rid in self._held:
                self._held[rid] = (self._held[rid][0], now + lease_s)

    def levels(self, keys: list[str]) -> list[Level]:
        return [Level(*self._levels.get(k, (0.0, 0.0))) for k in keys]

    def reset(self, keys: list[str]) -> None:
        """Spend forgotten (an operator's reset); what is reserved stays reserved."""
        for k in keys:
            if k in self._levels:
                self._levels[k][0] = 0.0

    def _sweep(self, now: float) -> None:
        for rid in [rid for rid, (_, until) in self._held.items() if until < now]:
            for key, amount in self._held.pop(rid)[0]:
                self._levels[key][1] -= amount
