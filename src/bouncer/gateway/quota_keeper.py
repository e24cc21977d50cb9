"""The gateway's side of quotas: a request reserves before the offer, settles when it ends.

- `reserve` (awaited, one Redis call, before the offer): the request's expected cost (prompt
  plus its tenant's predicted output, not max_tokens) on every line of its tenant's limits. No
  room: the tenant's `over` choice goes to the core (`RequestInfo.over_quota`); demoted and
  diverted requests still reserve, their spend counts.
- `settle` (in the background): when it ends, what it used (the usage its answer reported,
  prompt and completion tokens, at the price of whoever served it) replaces the reservation; a
  request refused, expired or cancelled before it ran gives all of it back.
- every lease_s / 3 the reservations this gateway holds (queued or being served) are renewed; a
  gateway that dies stops renewing, and its reservations are given back within lease_s.
- every REFRESH_S the levels of the lines in force are read, for metrics and /admin/state.

Redis away (a call failed or took longer than `quotas.timeout_ms`): until a call in the
background succeeds again, requests do not wait on Redis at all. Fail-open admits without
reserving, but a tenant the last levels read showed past a limit stays past it (refused, demoted or
diverted as it says), and the spend of what it served is settled once Redis answers again: summed
per limit and window, so the backlog is as large as the lines in force however long Redis is away,
and written once (a batch sent again after a timeout counts once). A settle that was sent when
Redis failed may have run (a frozen Redis runs what waited in its socket when it thaws): it is sent
again under its own id, which counts once. Fail-closed refuses limited tenants' requests with 503
until Redis answers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from bouncer.config import BouncerConfig
from bouncer.core.requests import OverQuota
from bouncer.gateway.quota_store import RedisQuotaLedger
from bouncer.quotas.book import Asked, QuotaBook
from bouncer.quotas.ledger import Level
from bouncer.quotas.plan import Charge

log = logging.getLogger("bouncer.gateway")

REFRESH_S = 5.0
# settles sent when the store failed, kept to send again under their own ids (each counts once);
# past this many, the oldest are summed into the backlog (a Redis that thaws could then count one twice)
IN_DOUBT_KEPT = 10_000
UNAVAILABLE = OverQuota("unavailable", 0, 1.0, "the quota store (Redis) is unreachable")


class QuotaKeeper:
    def __init__(self, config: BouncerConfig, wall: Callable[[], float] = time.time) -> None:
        q = config.quotas
        assert q is not None
        url = q.url or config.shared_state.url  # type: ignore[union-attr]  (checked by the config)
        self.store = RedisQuotaLedger(url, q.key_prefix, q.timeout_ms / 1000)
        self.wall = wall
        self.instance = secrets.token_hex(6)  # reservation ids are unique across gateways and restarts
        self.degraded = False
        self.levels: dict[str, Level] = {}  # key -> as last read
        self.failures = 0  # Redis calls that failed
        self.book = QuotaBook(config)
        # spend to write once Redis is back, summed per line: key -> [amount, expire_at]; and the
        # batch of it being written (its id makes a batch sent twice count once)
        self._backlog: dict[str, list[float]] = {}
        self._backlog_requests = 0
        self._writing: tuple[str, dict[str, list[float]], int] | None = None
        self._batches = itertools.count()
        self._in_doubt: list[tuple[str, list[tuple[str, float, float]]]] = []  # settles sent that failed
        self._tasks: set[asyncio.Task] = set()
        self.reconfigure(config)

    def reconfigure(self, config: BouncerConfig) -> None:
        """A reload's limits (the store's URL is read at start only)."""
        self.book.reconfigure(config)
        q = config.quotas
        self.lease_s = q.lease_s if q is not None else 60.0
        self.fail_closed = q is not None and q.on_unavailable == "fail-closed"

    def applies(self, tenant: str) -> bool:
        return self.book.applies(tenant)

    # -- the request path --------------------------------------------------------------------------
    async def reserve(self, rid: str, tenant: str, model: str, prompt_tokens: int,
                      predicted_output: int) -> OverQuota | None:
        """Reserve a request's expected cost; None: it fits, else what its tenant's requests get.
        While the store is known to be away, answered at once, without it."""
        at = self.wall()
        asked = self.book.ask(tenant, model, prompt_tokens, predicted_output, at)
        if not self.degraded:
            try:
                full = await self.store.reserve(self._id(rid), asked.holds, asked.force, self.lease_s)
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed("reserve", exc)
            else:
                self._recovered()
                return self.book.answered(rid, asked, full, at)
        if self.fail_closed:
            return UNAVAILABLE
        return self._without_store(rid, asked, at)

    def _without_store(self, rid: str, asked: Asked, at: float) -> OverQuota | None:
        """Fail-open: admitted without a reservation, unless the levels last read (and the spend
        waiting to be written) already put a line of its tenant past its limit."""
        full = []
        for i, c in enumerate(asked.charges):
            level = self.levels.get(c.key, Level(0.0, 0.0))
            waiting = self._backlog.get(c.key, (0.0,))[0]
            if level.spent + level.reserved + waiting + c.amount > c.line.limit.limit:
                full.append(i)
        over = self.book.answered(rid, asked, full, at)
        if rid in self.book.held:
            self.book.unreserved(rid, asked)  # admitted: its spend is settled once the store is back
        return over

    def settle(self, rid: str, prompt_tokens: int, completion_tokens: int | None,
               overflow_target: str | None = None) -> None:
        """It ended having used these (0 and 0: it never ran; completion None: its answer was
        not seen, charged what it reserved); written in the background."""
        used = self.book.used(rid, prompt_tokens, completion_tokens, overflow_target)
        if used is None:
            return
        task = asyncio.get_running_loop().create_task(self._settle(self._id(rid), used))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def release(self, rid: str) -> None:
        """It never ran (refused, expired, cancelled while queued): its reservation goes back."""
        self.settle(rid, 0, 0)

    async def _settle(self, sid: str, used: list[tuple[str, float, float]]) -> None:
        if not self.degraded:
            try:
                await self.store.settle(sid, used)
                self._recovered()
                return
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed("settle", exc)
                # sent, and maybe run (a frozen Redis runs what waited in its socket once it thaws):
                # sent again under its own id, which counts once
                self._in_doubt.append((sid, used))
                if len(self._in_doubt) > IN_DOUBT_KEPT:
                    self._add_to_backlog(self._in_doubt.pop(0)[1])
                return
        self._add_to_backlog(used)  # never sent: summed with the rest

    def _add_to_backlog(self, used: list[tuple[str, float, float]]) -> None:
        # its reservation, if it made one, goes back when its lease runs out (no one renews it)
        for key, amount, expire_at in used:
            line = self._backlog.setdefault(key, [0.0, expire_at])
            line[0] += amount
            line[1] = max(line[1], expire_at)
        self._backlog_requests += 1

    async def _write_backlog(self) -> None:
        """The spend that waited for the store, as one settle under a batch id of its own (sent
        again under the same id until it is written: a timeout that did write counts once)."""
        if self._writing is None:
            if not self._backlog:
                return
            self._writing = (f"backlog-{next(self._batches)}", self._backlog, self._backlog_requests)
            self._backlog, self._backlog_requests = {}, 0
        sid, lines, _ = self._writing
        await self.store.settle(self._id(sid), [(key, amount, expire_at) for key, (amount, expire_at) in lines.items()])
        self._writing = None

    def _id(self, rid: str) -> str:
        return f"{self.instance}:{rid}"

    # -- in the background -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Renew this gateway's reservations, write what waits to be settled, read the levels."""
        next_refresh = 0.0
        while True:
            try:
                held = [self._id(rid) for rid, h in self.book.held.items() if h.reserved]
                await self.store.renew(held, self.lease_s)
                while self._in_doubt:
                    sid, used = self._in_doubt[0]
                    await self.store.settle(sid, used)  # a settle sent twice counts once
                    self._in_doubt.pop(0)
                await self._write_backlog()
                if time.monotonic() >= next_refresh:
                    await self.refresh()
                    next_refresh = time.monotonic() + REFRESH_S
                self._recovered()
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed("renew", exc)
            await asyncio.sleep(min(self.lease_s / 3, REFRESH_S))

    async def refresh(self) -> None:
        keys = [c.key for c in self.current()]
        self.levels = dict(zip(keys, await self.store.levels(keys), strict=True))

    def current(self, tenant: str | None = None) -> list[Charge]:
        return self.book.current(self.wall(), tenant)

    async def reset(self, charges: list[Charge]) -> None:
        """These lines' spend in their current windows forgotten (an operator's `bouncer quota
        reset`); reservations stay."""
        await self.store.reset([c.key for c in charges])

    def report(self, tenant: str | None = None) -> list[dict]:
        """The lines in force (or `tenant`'s) with their levels as last read (`/admin/state`,
        metrics, `bouncer quota show`)."""
        return [self.book.row(c, self.levels.get(c.key, Level(0.0, 0.0))) for c in self.current(tenant)]

    @property
    def backlog_lines(self) -> int:
        """Limit lines whose spend waits for the store (what its backlog holds, whatever the
        requests' number)."""
        return len(self._backlog) + (len(self._writing[1]) if self._writing is not None else 0)

    @property
    def unsettled(self) -> int:
        """Requests whose spend waits for the store."""
        return len(self._in_doubt) + self._backlog_requests + (self._writing[2] if self._writing is not None else 0)

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        if not self.degraded:
            log.warning("quota store unreachable", extra={"event": "quota_store", "call": what, "error": repr(exc)})
        self.degraded = True

    def _recovered(self) -> None:
        if self.degraded:
            log.info("quota store answers again", extra={"event": "quota_store", "unsettled": self.unsettled})
        self.degraded = False

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.store.close()
