"""What several gateways share, in Redis: tenants' rate-limit buckets, each gateway's part of the
fleet's load and tenants' service, and who is alive.

Each gateway behind one load balancer runs its own core; without this, each enforces every
tenant's limit on its own and together they let through the limit times their number (what
LiteLLM's users report of its multi-instance rate limits). With `shared_state` set:
- a request of a rate-limited tenant costs one Redis call (`TAKE`, a Lua script: both buckets
  checked and charged at once, on Redis's own clock so gateways' clocks need not agree), made
  before the offer; its verdict goes to the core through `SharedRateLimits`. Charges the core
  gives back are sent back in the background (`REFUND`);
- every gateway renews its presence every lease_s / 3 (`HEARTBEAT`: a sorted set scored by
  Redis's time); the ones seen within lease_s are counted, and that count is each gateway's share
  of every limit if Redis goes away;
- a retry (its client says so) costs one Redis call before the offer: its first attempt's
  arrival, wherever it came (`SharedRetries`); first attempts and completions are written back in
  the background, one pipelined call per turn of the loop;
- a dispatch that would leave its replica nearly full (`bouncer.core.sharing.claims`) costs one Redis
  call before it is sent (`CLAIM`: what the other gateways hold there now, against what the core
  counted; the blocks added to this gateway's if it holds). Each sync writes every replica's
  blocks of this gateway in full (`CLAIMS_SET`), with its lease;
- every sync_ms, off the request path, each gateway writes its part (`AdmissionCore.own_share`:
  its requests on each replica, its tenants' decayed service, its queued heads) and reads the
  others' in the same call (`SYNC`); a part not rewritten within lease_s is dropped, so a killed
  gateway's requests stop counting within lease_s. While no sync succeeds, the last view holds for
  lease_s, then this gateway counts only its own (`bouncer.core.sharing.peers`).

Redis unreachable, slower than timeout_ms, or answering an error: the gateway degrades at once and
stops asking Redis on the request path. fail-open decides locally with its share of each limit;
fail-closed refuses rate-limited tenants' requests with 503 `shared_state_unavailable` and
Retry-After. A probe every PROBE_S tries Redis again; its first answer ends the degradation (a
Redis restarted empty has every bucket full again: one burst each, as after a fresh start).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from bouncer.config import SharedState as SharedStateConfig
from bouncer.core.intake.rate_limit import Bucket
from bouncer.core.outcomes import Claim, Reason
from bouncer.core.requests import RetryKey
from bouncer.core.sharing.first_attempts import SharedRetries
from bouncer.core.sharing.peers import GatewayShare
from bouncer.core.sharing.shared_rate_limits import SharedRateLimits, Verdict

log = logging.getLogger("bouncer.gateway")

# While degraded, how often Redis is tried again: a refused connection costs next to nothing, and
# a Redis that came back is shared again within about this (bench gateways' faults run).
PROBE_S = 0.25
FAIL_CLOSED_RETRY_S = 1.0  # the Retry-After of a fail-closed refusal

# A bucket is a hash {level, at}; absent means full. The request bucket's unit is one request,
# the token bucket's the request's charge (capped at the burst, as the local buckets do).
_BUCKETS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, rate, burst)
  local v = redis.call('HMGET', key, 'level', 'at')
  local lvl, at = tonumber(v[1]), tonumber(v[2])
  if lvl == nil then return burst end
  return math.min(burst, lvl + math.max(0, now - at) * rate)
end
local function store(key, rate, burst, lvl)
  redis.call('HSET', key, 'level', tostring(lvl), 'at', tostring(now))
  redis.call('PEXPIRE', key, math.ceil((burst - lvl) / rate * 1000) + 1000)
end
local rr, rb, tr, tb, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
"""

TAKE = _BUCKETS + """
local rl, tl = -1, -1
if rr > 0 then rl = level(KEYS[1], rr, rb) end
if tr > 0 then tl = level(KEYS[2], tr, tb) end
local one, need = math.min(1, rb), math.min(n, tb)
if rr > 0 and rl < one then return {1, tostring((one - rl) / rr), tostring(rl), tostring(tl)} end
if tr > 0 and tl < need then return {2, tostring((need - tl) / tr), tostring(rl), tostring(tl)} end
if rr > 0 then rl = rl - one; store(KEYS[1], rr, rb, rl) end
if tr > 0 then tl = tl - need; store(KEYS[2], tr, tb, tl) end
return {0, '0', tostring(rl), tostring(tl)}
"""

REFUND = _BUCKETS + """
if rr > 0 then store(KEYS[1], rr, rb, math.min(rb, level(KEYS[1], rr, rb) + math.min(1, rb))) end
if tr > 0 then store(KEYS[2], tr, tb, math.min(tb, level(KEYS[2], tr, tb) + math.min(n, tb))) end
return 0
"""

# a served request's token charge settled at what it used (ARGV[6]): the difference given back or
# taken, each as the bucket counted it (at most a burst); the level may go below empty
SETTLE_TOKENS = _BUCKETS + """
local diff = math.min(n, tb) - math.min(tonumber(ARGV[6]), tb)
if tr > 0 and diff ~= 0 then store(KEYS[2], tr, tb, math.min(tb, level(KEYS[2], tr, tb) + diff)) end
return 0
"""

HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[2]))
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) * 2000))
return redis.call('ZCARD', KEYS[1])
"""

SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], string.format('%.6f', now) .. ' ' .. ARGV[2])
local all = redis.call('HGETALL', KEYS[1])
local others = {}
for i = 1, #all, 2 do
  local id, v = all[i], all[i + 1]
  local sp = string.find(v, ' ', 1, true)
  if sp == nil or now - tonumber(string.sub(v, 1, sp - 1)) > lease then
    redis.call('HDEL', KEYS[1], id)
  elseif id ~= ARGV[1] then
    table.insert(others, string.sub(v, sp + 1))
  end
end
redis.call('PEXPIRE', KEYS[1], math.ceil(lease * 2000))
return others
"""

# A replica's claims (`bouncer.core.sharing.claims`): a hash per replica, one field per gateway, "expiry
# blocks" (Redis's time). Every sync writes each gateway's blocks there in full; a claim adds to
# them. All in one hash slot, for Redis Cluster: a sync writes every replica's in one call.
CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local me, blocks, seen = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local slack, lease = tonumber(ARGV[4]), tonumber(ARGV[5])
local all = redis.call('HGETALL', KEYS[1])
local others, mine = 0, 0
for i = 1, #all, 2 do
  local id, v = all[i], all[i + 1]
  local sp = string.find(v, ' ', 1, true)
  local held = sp and tonumber(string.sub(v, sp + 1))
  if held == nil or tonumber(string.sub(v, 1, sp - 1)) < now then
    redis.call('HDEL', KEYS[1], id)
  elseif id == me then
    mine = held
  else
    others = others + held
  end
end
if others - seen > slack then return {0, others} end
redis.call('HSET', KEYS[1], me, string.format('%.6f', now + lease) .. ' ' .. (mine + blocks))
redis.call('PEXPIRE', KEYS[1], math.ceil(lease * 2000))
return {1, others}
"""

CLAIMS_SET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local lease = tonumber(ARGV[2])
local expiry = string.format('%.6f', now + lease)
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], ARGV[1], expiry .. ' ' .. ARGV[i + 2])
  redis.call('PEXPIRE', KEYS[i], math.ceil(lease * 2000))
end
return #KEYS
"""

REASONS = {1: Reason.RATE_LIMITED_REQUESTS, 2: Reason.RATE_LIMITED_TOKENS}


def _args(limits: tuple[Bucket | None, Bucket | None], tokens: int) -> list[float | int]:
    requests, token_bucket = limits
    return [*(requests or (0, 0)), *(token_bucket or (0, 0)), tokens]


def _level(raw: bytes) -> float | None:
    value = float(raw)
    return None if value < 0 else value


async def _until(event: asyncio.Event, timeout_s: float) -> None:
    """Wait for `event` (then clear it), or `timeout_s`, whichever comes first."""
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        pass
    event.clear()


class SharedState:
    """This gateway's link to the shared Redis: the rate verdicts, the refunds, its presence."""

    def __init__(self, cfg: SharedStateConfig, store: SharedRateLimits, clock: Callable[[], float],
                 gateway_id: str | None = None, own_part: Callable[[], GatewayShare] | None = None,
                 seen: Callable[[list[GatewayShare]], None] | None = None,
                 retries: SharedRetries | None = None) -> None:
        """`own_part` and `seen`: this gateway's part of the fleet's state, and where the
        others' go (the core's `own_share` and `peers`); `retries`: the core's retry ledger,
        whose first attempts are shared. Without them only rate limits are shared."""
        self.cfg = cfg
        self.store = store
        self.retries = retries
        self._wall_offset = time.time() - clock()  # first attempts go to Redis in wall-clock time
        self.clock = clock
        self.own_part, self.seen = own_part, seen
        self.syncs = 0
        self.peers_seen = 0  # other gateways' parts in the last sync
        self._synced_at: float | None = None
        # unique per gateway, even for two in one process
        self.gateway_id = gateway_id or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.available = False
        self.calls_failed = 0
        self.refunds_lost = 0  # charges that could not be given back (Redis went away meanwhile)
        self.claims = {"held": 0, "refused": 0}  # dispatches to a nearly full replica (`core.claims`)
        self._redis = aioredis.from_url(cfg.url, socket_timeout=cfg.timeout_ms / 1000,
                                        socket_connect_timeout=cfg.timeout_ms / 1000, retry_on_timeout=False)
        self._take = self._redis.register_script(TAKE)
        self._refund = self._redis.register_script(REFUND)
        self._settle_tokens = self._redis.register_script(SETTLE_TOKENS)
        self._heartbeat = self._redis.register_script(HEARTBEAT)
        self._sync = self._redis.register_script(SYNC)
        self._claim = self._redis.register_script(CLAIM)
        self._claims_set = self._redis.register_script(CLAIMS_SET)
        self._task: asyncio.Task | None = None
        self._sync_task: asyncio.Task | None = None
        # set before the tasks are cancelled: a loop ends at its next turn even if a cancellation
        # was lost on the way (seen once in 20 runs on a loaded machine, a sync loop outliving
        # its cancel and its gateway's close)
        self._stopping = False
        # Redis answering again, or failing: the sync and the presence probe go at once (not after
        # their period: a lease_s / 3 wait kept a Redis back for seconds unshared)
        self._back, self._down = asyncio.Event(), asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self._pending: list[tuple[str, int, asyncio.Future]] = []  # takes asked in this turn of the loop
        store.degraded = True  # until Redis first answers

    def _claims_key(self, replica: str) -> str:
        return f"{self.cfg.key_prefix}{{claims}}:{replica}"

    def _keys(self, tenant: str) -> list[str]:
        # one hash tag per tenant: both of its buckets on one Redis Cluster slot, for the script
        base = f"{self.cfg.key_prefix}rl:{{{tenant}}}"
        return [base + ":requests", base + ":tokens"]

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        await self._beat()
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._presence())
        if self.own_part is not None:
            self._sync_task = loop.create_task(self._syncing())

    def stop_tasks(self) -> None:
        """Stop the presence and sync loops, saying nothing to Redis (what `close` starts with;
        alone, what a killed gateway's Redis sees)."""
        self._stopping = True
        self._down.set()  # a loop waiting on these wakes to find it stopping
        self._back.set()
        for task in (self._task, self._sync_task):
            if task is not None:
                task.cancel()

    async def close(self) -> None:
        self.stop_tasks()
        for task in (self._task, self._sync_task):
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.available:  # leave the count, and the others' view, at once, not after lease_s
            try:
                await self._redis.zrem(self.cfg.key_prefix + "gateways", self.gateway_id)
                await self._redis.hdel(self.cfg.key_prefix + "parts", self.gateway_id)
            except (RedisError, OSError):
                pass
        await self._redis.aclose()

    async def _presence(self) -> None:
        while True:
            if self.available:
                await _until(self._down, self.cfg.lease_s / 3)
            else:
                await asyncio.sleep(PROBE_S)
            if self._stopping:
                return
            await self._beat()

    async def _beat(self) -> None:
        try:
            live = await self._heartbeat(keys=[self.cfg.key_prefix + "gateways"],
                                         args=[self.gateway_id, self.cfg.lease_s])
        except (RedisError, OSError) as exc:
            self._failed(exc)
            return
        self.store.set_gateways(int(live), self.clock())
        if not self.available:
            log.info("shared state reachable: rate limits shared by %d gateways", live,
                     extra={"event": "shared_state_up", "gateways": int(live)})
            self._back.set()
        self.available = True
        self.store.degraded = False

    async def _syncing(self) -> None:
        while True:
            if self.available:
                await asyncio.sleep(self.cfg.sync_ms / 1000)
            else:  # until the presence probe finds Redis again; a sync then publishes this part at once
                await _until(self._back, PROBE_S)
            if self._stopping:
                return
            await self.sync()

    async def sync(self) -> None:
        """Publish this gateway's part and take the others' (one call). Failing, the last view
        holds for lease_s, then is dropped: this gateway then counts only its own."""
        assert self.own_part is not None and self.seen is not None
        share = self.own_part()
        part = json.dumps(share.to_wire(), separators=(",", ":"))
        names = sorted(share.replicas)
        try:
            pipe = self._redis.pipeline(transaction=False)
            await self._sync(keys=[self.cfg.key_prefix + "parts"], args=[self.gateway_id, part, self.cfg.lease_s],
                             client=pipe)  # (queued: the pipeline sends both at once)
            if names:  # what it holds on each replica, in full: its claims since the last sync folded in
                await self._claims_set(keys=[self._claims_key(n) for n in names],
                                       args=[self.gateway_id, self.cfg.lease_s,
                                             *(share.replicas[n].blocks for n in names)], client=pipe)
            raw = (await pipe.execute())[0]
        except (RedisError, OSError) as exc:
            self._failed(exc)
            if self._synced_at is not None and self.clock() - self._synced_at > self.cfg.lease_s:
                self._synced_at = None
                self.peers_seen = 0
                self.seen([])
            return
        others = [GatewayShare.from_wire(json.loads(blob)) for blob in raw]
        self.syncs += 1
        self.peers_seen = len(others)
        self._synced_at = self.clock()
        self.seen(others)

    def _failed(self, exc: BaseException) -> None:
        self.calls_failed += 1
        if self.available or self.calls_failed == 1:
            log.warning("shared state unreachable (%s): %s", self.cfg.on_unavailable, exc or type(exc).__name__,
                        extra={"event": "shared_state_down", "error": str(exc) or type(exc).__name__,
                               "gateways_share": self.store.gateways})
        self.available = False
        self.store.degraded = True
        self._down.set()

    # -- the request path -------------------------------------------------------------------------
    async def charge(self, tenant: str, tokens: int) -> None:
        """Fetch the verdict for a request `offer` will charge `tokens`, and hand it to the
        store (none while Redis is away and the config fails open: the local share decides)."""
        if not self.available:
            if self.cfg.on_unavailable == "fail-closed":
                self.store.prepay(tenant, tokens, (Reason.SHARED_STATE_UNAVAILABLE, FAIL_CLOSED_RETRY_S))
            return
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()
        self._pending.append((tenant, tokens, answer))
        if len(self._pending) == 1:
            loop.call_soon(self._send_pending)
        try:
            code, wait, requests, token_level = await answer
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(exc)
            return await self.charge(tenant, tokens)  # degraded now: as configured
        self.store.report(tenant, _level(requests), _level(token_level), self.clock())
        verdict: Verdict = None if int(code) == 0 else (REASONS[int(code)], float(wait))
        self.store.prepay(tenant, tokens, verdict)

    def _send_pending(self) -> None:
        """The requests that asked in this turn of the loop go in one round trip."""
        batch, self._pending = self._pending, []
        task = asyncio.get_running_loop().create_task(self._take_batch(batch))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _take_batch(self, batch: list[tuple[str, int, asyncio.Future]]) -> None:
        try:
            if len(batch) == 1:
                tenant, tokens, _ = batch[0]
                answers = [await self._take(keys=self._keys(tenant), args=_args(self.store.limits(tenant), tokens))]
            else:
                answers = await self._take_many(batch)
        except (TimeoutError, RedisError, OSError) as exc:
            answers = [exc] * len(batch)
        for (_, _, answer), result in zip(batch, answers, strict=True):
            if answer.done():
                continue
            if isinstance(result, BaseException):
                answer.set_exception(result)
            else:
                answer.set_result(result)

    async def _take_many(self, batch: list[tuple[str, int, asyncio.Future]]) -> list:
        def pipeline():
            pipe = self._redis.pipeline(transaction=False)
            for tenant, tokens, _ in batch:
                pipe.evalsha(self._take.sha, 2, *self._keys(tenant), *_args(self.store.limits(tenant), tokens))
            return pipe

        answers = await pipeline().execute(raise_on_error=False)
        if any(isinstance(a, NoScriptError) for a in answers):  # a Redis restarted empty: load it, once
            await self._redis.script_load(TAKE)
            answers = await pipeline().execute(raise_on_error=False)
        return answers

    # -- claims -----------------------------------------------------------------------------------
    async def claim(self, replica: str, claim: Claim) -> int | None:
        """Claim a dispatch to a nearly full replica (`bouncer.core.sharing.claims`): None if it holds
        (or Redis is away: the local view decides, as one gateway alone would), else the blocks
        the other gateways hold there now, for `AdmissionCore.unclaimed`."""
        if not self.available:
            return None
        try:
            held, others = await self._claim(keys=[self._claims_key(replica)],
                                             args=[self.gateway_id, claim.blocks, claim.others_seen, claim.slack,
                                                   self.cfg.lease_s])
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(exc)
            return None
        if int(held):
            self.claims["held"] += 1
            return None
        self.claims["refused"] += 1
        return int(others)

    # -- retries ----------------------------------------------------------------------------------
    def _retry_key(self, key: RetryKey) -> str:
        tenant, model, digest, max_tokens = key
        return f"{self.cfg.key_prefix}retry:{len(tenant)}:{tenant}:{model}:{digest}:{max_tokens}"

    async def first_attempt(self, key: RetryKey) -> None:
        """Before a retry is offered: when its first attempt came, as any gateway recorded it."""
        if self.retries is None or not self.available:
            return
        try:
            raw = await self._redis.get(self._retry_key(key))
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(exc)
            return
        self.retries.prefetch(key, None if raw is None else float(raw) - self._wall_offset)

    async def _publish_retries(self, recorded: list[tuple[RetryKey, float]], completed: list[RetryKey]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        keep_ms = int(self.retries.remember_s * 1000)  # type: ignore[union-attr]
        for key, at in recorded:  # the earliest gateway to see it wins (NX)
            pipe.set(self._retry_key(key), repr(at + self._wall_offset), nx=True, px=keep_ms)
        for key in completed:
            pipe.delete(self._retry_key(key))
        try:
            await pipe.execute()
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(exc)

    def settle(self) -> None:
        """After a core call: send back what the core did not take, and what it refunded; and
        the first attempts recorded and requests completed here."""
        if self.retries is not None:
            recorded, completed = self.retries.drain()
            if (recorded or completed) and self.available:
                task = asyncio.get_running_loop().create_task(self._publish_retries(recorded, completed))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        back, settled = self.store.unconsumed() + self.store.drain_refunds(), self.store.drain_settled()
        if (back or settled) and not self.available:
            self.refunds_lost += len(back) + len(settled)
        elif back or settled:
            task = asyncio.get_running_loop().create_task(self._give_back(back, settled))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _give_back(self, charges: list[tuple[str, int]], settled: list[tuple[str, int, int]]) -> None:
        """Charges given back, and served requests' token charges settled, in one pipelined call."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for tenant, tokens in charges:
                    await self._refund(keys=self._keys(tenant), args=_args(self.store.limits(tenant), tokens),
                                       client=pipe)
                for tenant, charged, used in settled:
                    _, tokens = self.store.limits(tenant)
                    await self._settle_tokens(keys=self._keys(tenant), args=[*_args((None, tokens), charged), used],
                                              client=pipe)
                await asyncio.wait_for(pipe.execute(), self.cfg.timeout_ms / 1000)
        except (TimeoutError, RedisError, OSError) as exc:
            self._failed(exc)
            # the tenants' budgets are off by these until they refill
            self.refunds_lost += len(charges) + len(settled)
