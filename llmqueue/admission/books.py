"""Admission's books in Redis that both sides keep: reservations refunded, drain rate, engine lead.

Admission (the API) reserves prompt tokens + max_tokens from a tenant's tokens-per-minute bucket and
reads each queue's drain rate and engine lead; the worker's recorder gives back what a finished
request did not use (`refund`), and feeds the drain rate (`record_drain`, as requests are claimed)
and the engine lead (`record_leads`, engine → first token). The keys are contract.keys'.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import redis
from django.conf import settings

from contract.keys import bucket_key, drain_key, waiting_key
from llmqueue import lua
from llmqueue.redis_client import get_redis

# A drain rate counted for less than this many seconds is divided by it: the few claims just after
# a queue's start never show more than they are (a first claim alone would be an infinite rate).
MIN_DRAIN_SPAN_SECONDS = 1.0

# Lua: the decision's clock, ARGV[1] when a test gives one, else Redis' own (one timeline for every
# replica whatever their clocks).
LUA_NOW = """
local now = tonumber(ARGV[1])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
"""

# KEYS[1] the tenant's token bucket; ARGV: now ('' = server time), tokens to give back.
_REFUND = (
    LUA_NOW
    + """
local t = redis.call('HMGET', KEYS[1], 'tokens', 'ts', 'cap')
if not t[1] then
  return 0  -- no bucket: it would have refilled to full by now
end
local cap, ts = tonumber(t[3]), tonumber(t[2])
now = math.max(now, ts)  -- never move the bucket's clock back (a replica's clock behind)
local tokens = math.min(cap, tonumber(t[1]) + (now - ts) * cap / 60)
tokens = math.min(cap, tokens + tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
return 1
"""
)

# KEYS[1] a queue's drain hash; ARGV: now ('' = server time), sum of engine lead seconds, how
# many, tau seconds. A decayed mean and variance: recent requests weigh most, as in the drain
# rate. A batch gives only its sum, so the variance is the spread of batch means (each weighed by
# its size: sq sums sum^2 / n, b counts batches), unbiased for one request's when they are alike.
_LEAD = (
    LUA_NOW
    + """
local d = redis.call('HMGET', KEYS[1], 'lead_sum', 'lead_n', 'lead_ts', 'lead_sq', 'lead_b')
local sum, n, sq, b = 0, 0, 0, 0
if d[1] then
  local decay = math.exp(-math.max(0, now - tonumber(d[3])) / tonumber(ARGV[4]))
  sum, n = tonumber(d[1]) * decay, tonumber(d[2]) * decay
  sq, b = tonumber(d[4] or '0') * decay, tonumber(d[5] or '0') * decay
end
local add, count = tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'lead_sum', tostring(sum + add), 'lead_n', tostring(n + count),
           'lead_ts', tostring(now), 'lead_sq', tostring(sq + add * add / count),
           'lead_b', tostring(b + 1))
redis.call('EXPIRE', KEYS[1], math.ceil(10 * tonumber(ARGV[4])))
return 1
"""
)

# KEYS[1] a queue's drain hash; ARGV: now ('' = server time), requests claimed, tau seconds.
# `since` dates the count's start: the first claim, or the first after 3 tau without one (when
# admission stops trusting the rate), so the rate divides by the time it really counted.
_DRAIN = (
    LUA_NOW
    + """
local tau = tonumber(ARGV[3])
local d = redis.call('HMGET', KEYS[1], 'count', 'ts', 'since')
local count, since = 0, now
if d[1] and now - tonumber(d[2]) < 3 * tau then
  count = tonumber(d[1]) * math.exp(-math.max(0, now - tonumber(d[2])) / tau)
  since = tonumber(d[3] or (now - 100 * tau))
end
redis.call('HSET', KEYS[1], 'count', tostring(count + tonumber(ARGV[2])), 'ts', tostring(now),
           'since', tostring(since))
redis.call('EXPIRE', KEYS[1], math.ceil(10 * tau))
return 1
"""
)


@cache
def _scripts() -> dict[str, Any]:
    client = get_redis()
    sources = {"refund": _REFUND, "drain": _DRAIN, "lead": _LEAD}
    return {name: client.register_script(source) for name, source in sources.items()}


def drain_tau_seconds() -> float:
    """The drain rate's decay time constant (settings give its half-life)."""
    return float(settings.LLMQUEUE_DRAIN_HALF_LIFE_SECONDS) / math.log(2)


def drain_rate(fields: list[Any], now: float, tau: float) -> float:
    """A queue's drain rate (requests/s) from its drain hash's count, ts and since, as the
    admission script computes it (decision.py, same formula) for readers outside the script."""
    count, ts, since = (None if v is None else float(v) for v in (fields + [None] * 3)[:3])
    if count is None or ts is None or now - ts >= 3 * tau:
        return 0.0
    span = max(MIN_DRAIN_SPAN_SECONDS, now - (since if since is not None else now - 100 * tau))
    return count * math.exp(-(now - ts) / tau) / (tau * (1 - math.exp(-span / tau)))


def now_arg(now: float | None) -> str:
    return "" if now is None else repr(now)


def refund(
    pipe: redis.client.Pipeline, tenant_id: int, tokens: int, now: float | None = None
) -> None:
    """Queue on `pipe` the return of `tokens` a request reserved but did not use."""
    if tokens > 0:
        keys = [bucket_key("tokens", tenant_id)]
        lua.call(pipe, _scripts()["refund"], keys, [now_arg(now), tokens])


def record_drain(
    pipe: redis.client.Pipeline,
    queue: str,
    claimed: float,
    tenant_claims: dict[int, int],
    now: float | None = None,
) -> None:
    """Queue on `pipe`: `claimed` requests left `queue` for an engine (its drain rate), and each
    tenant's count of requests waiting in it drops by its claims."""
    args = [now_arg(now), claimed, drain_tau_seconds()]
    lua.call(pipe, _scripts()["drain"], [drain_key(queue)], args)
    for tenant_id, count in tenant_claims.items():
        pipe.decrby(waiting_key(queue, tenant_id), count)


def record_leads(
    pipe: redis.client.Pipeline, queue: str, seconds: float, count: int, now: float | None = None
) -> None:
    """Queue on `pipe`: `count` requests of `queue` took `seconds` in all from the engine getting
    them to their first token."""
    args = [now_arg(now), seconds, count, drain_tau_seconds()]
    lua.call(pipe, _scripts()["lead"], [drain_key(queue)], args)
