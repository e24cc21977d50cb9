"""Tenants' spend in Redis: the reservation rules of `bouncer.quotas.ledger`, as Lua scripts, so
that every gateway's reservation is one atomic step and the limit holds exactly across them
(the check-then-spend race that lets concurrent requests overspend does not exist here).

Per limit and window a hash {spent, reserved}, expiring some time after its window ends. The
reservations: a hash rid -> its lines and amounts (JSON), and a sorted set of their lease ends
(Redis's own clock, so gateways' clocks need not agree). A settled rid is remembered for ten
minutes, so a settle sent twice (a timeout, then a retry) counts once. Keys are not declared to Lua where
a reservation names them (a single Redis, not a Cluster).

Durability is Redis's: with `appendonly yes` a restarted Redis keeps the month's spend.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from bouncer.quotas.ledger import Hold, Level

# A settled rid is remembered this long (a key each: about 70 bytes, so 42 MB at 1,000 requests
# a second), so that a settle sent again after a timeout (`QuotaKeeper.run` retries within a
# third of a lease once Redis answers) counts once.
SETTLED_REMEMBERED_S = 600

_GIVE_BACK = """
local function give_back(held, leases, rid)
  local v = redis.call('HGET', held, rid)
  if v then
    local parts = cjson.decode(v)
    for i = 1, #parts, 2 do redis.call('HINCRBYFLOAT', parts[i], 'reserved', -tonumber(parts[i + 1])) end
    redis.call('HDEL', held, rid)
  end
  redis.call('ZREM', leases, rid)
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function sweep(held, leases)
  for _, old in ipairs(redis.call('ZRANGEBYSCORE', leases, '-inf', now, 'LIMIT', 0, 256)) do
    give_back(held, leases, old)
  end
end
"""

# KEYS: the lines' keys, then held, leases. ARGV: rid, lease_s, force, then per line limit, amount,
# expire_at_ms, blocks (1, or 0 for a shadow limit). Returns the 0-based indices of the lines
# without room (reserved on none of them where one of them blocks, unless force).
RESERVE = _GIVE_BACK + """
local n = #KEYS - 2
local held, leases = KEYS[n + 1], KEYS[n + 2]
sweep(held, leases)
local full, blocked = {}, false
for i = 1, n do
  local limit, amount = tonumber(ARGV[4 * i]), tonumber(ARGV[1 + 4 * i])
  local v = redis.call('HMGET', KEYS[i], 'spent', 'reserved')
  if (tonumber(v[1]) or 0) + (tonumber(v[2]) or 0) + amount > limit * (1 + 1e-12) then
    table.insert(full, i - 1)
    if ARGV[3 + 4 * i] == '1' then blocked = true end
  end
end
if blocked and ARGV[3] ~= '1' then return full end
local parts = {}
for i = 1, n do
  redis.call('HINCRBYFLOAT', KEYS[i], 'reserved', ARGV[1 + 4 * i])
  redis.call('PEXPIREAT', KEYS[i], ARGV[2 + 4 * i])
  table.insert(parts, KEYS[i])
  table.insert(parts, ARGV[1 + 4 * i])
end
redis.call('HSET', held, ARGV[1], cjson.encode(parts))
redis.call('ZADD', leases, now + tonumber(ARGV[2]), ARGV[1])
return full
"""

# KEYS: the lines' keys, then held, leases, the settled marker. ARGV: rid, then per line amount,
# expire_at_ms. Returns 0 when this rid was settled already.
SETTLE = _GIVE_BACK + f"""
local n = #KEYS - 3
if redis.call('SET', KEYS[n + 3], '1', 'NX', 'EX', {SETTLED_REMEMBERED_S}) == false then return 0 end
give_back(KEYS[n + 1], KEYS[n + 2], ARGV[1])
for i = 1, n do
  if tonumber(ARGV[2 * i]) ~= 0 then redis.call('HINCRBYFLOAT', KEYS[i], 'spent', ARGV[2 * i]) end
  redis.call('PEXPIREAT', KEYS[i], ARGV[1 + 2 * i])
end
return 1
"""

# KEYS: held, leases. ARGV: lease_s, then the rids still held. Gives back the expired first.
RENEW = _GIVE_BACK + """
sweep(KEYS[1], KEYS[2])
for i = 2, #ARGV do redis.call('ZADD', KEYS[2], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
return 1
"""


class RedisQuotaLedger:
    """`LocalQuotaLedger`'s methods, kept in Redis (awaited; each one call)."""

    def __init__(self, url: str, key_prefix: str, timeout_s: float) -> None:
        self.redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.timeout_s = timeout_s
        self._held = key_prefix + "quota-held"
        self._leases = key_prefix + "quota-leases"
        self._settled = key_prefix + "quota-settled:"
        self._reserve = self.redis.register_script(RESERVE)
        self._settle = self.redis.register_script(SETTLE)
        self._renew = self.redis.register_script(RENEW)

    async def reserve(self, rid: str, holds: list[Hold], force: bool, lease_s: float) -> list[int]:
        args: list = [rid, lease_s, "1" if force else "0"]
        for h in holds:
            args += [repr(h.limit), repr(h.amount), int(h.expire_at * 1000), "1" if h.blocks else "0"]
        full = await self._call(self._reserve([*[h.key for h in holds], self._held, self._leases], args))
        return [int(i) for i in full]

    async def settle(self, rid: str, used: list[tuple[str, float, float]]) -> bool:
        """`used`: (key, amount, expire_at) per line. False: it was settled already."""
        args: list = [rid]
        for _, amount, expire_at in used:
            args += [repr(amount), int(expire_at * 1000)]
        keys = [k for k, _, _ in used] + [self._held, self._leases, self._settled + rid]
        return bool(await self._call(self._settle(keys, args)))

    async def renew(self, rids: list[str], lease_s: float) -> None:
        await self._call(self._renew([self._held, self._leases], [lease_s, *rids]))

    async def levels(self, keys: list[str]) -> list[Level]:
        if not keys:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for k in keys:
                pipe.hmget(k, "spent", "reserved")
            rows = await self._call(pipe.execute())
        return [Level(float(s or 0), max(0.0, float(r or 0))) for s, r in rows]

    async def reset(self, keys: list[str]) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for k in keys:
                pipe.hset(k, "spent", 0)
            await self._call(pipe.execute())

    async def _call(self, call):
        async with asyncio.timeout(self.timeout_s):  # past it the store is away: requests stop waiting on it
            return await call

    async def close(self) -> None:
        await self.redis.aclose()
