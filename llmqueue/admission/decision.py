"""The admission decision: tenant rate and token quotas, tier backpressure, in one Redis round trip.

One Lua script decides each request atomically for every API replica: is a worker alive for the
queue; is the queue below its depth cap, and would the request's estimated wait (requests ahead ÷
the queue's recent drain rate) still meet its deadline (or, LLMQUEUE_SHED_AT_SLO, would a
quantile of its wait to a first token, LLMQUEUE_SHED_WAIT_QUANTILE, meet its tier's first-token
target); does the tenant's request bucket (rate + burst) have a token; does its tokens-per-minute
bucket hold prompt tokens + max_tokens. Only an admitted request takes from the buckets; a
rejection names its reason and when to retry. Usage counters and the config version (for cache
invalidation) ride along in the same round trip. What workers give back and measure is in
llmqueue/admission/books.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from functools import cache
from statistics import NormalDist
from typing import Any

from django.conf import settings

from contract import latency, liveness
from contract.keys import (
    CONFIG_VERSION_KEY,
    TOTALS_INDEX_KEY,
    USAGE_INDEX_KEY,
    admissions_window_key,
    bucket_key,
    drain_key,
    totals_key,
    waiting_key,
)
from llmqueue import usage
from llmqueue.admission.books import LUA_NOW, MIN_DRAIN_SPAN_SECONDS, drain_tau_seconds, now_arg
from llmqueue.queueing.deadline_order import LUA_DEADLINES, WALK_LIMIT
from llmqueue.queueing.publishing import PUBLISH_GRACE_SECONDS, publishing_key
from llmqueue.redis_client import get_redis

# Rejection reasons, as the script returns them and usage counts them.
RATE, TOKENS = "rate", "tokens"
NO_WORKER, QUEUE_FULL, TOO_SLOW, TENANT_SHARE = (
    "no_worker",
    "queue_full",
    "too_slow",
    "tenant_share",
)

_ADMIT = (
    LUA_DEADLINES
    + f"local WALK_LIMIT = {WALK_LIMIT}\nlocal MIN_DRAIN_SPAN = {MIN_DRAIN_SPAN_SECONDS!r}\n"
    + f"local PUBLISH_GRACE = {PUBLISH_GRACE_SECONDS}\n"
    + LUA_NOW
    + """
local rps, burst = tonumber(ARGV[2]), tonumber(ARGV[3])
local tpm, need = tonumber(ARGV[4]), tonumber(ARGV[5])
local max_depth, max_wait = tonumber(ARGV[6]), tonumber(ARGV[7])
local stale, tau = tonumber(ARGV[8]), tonumber(ARGV[9])
local usage_ttl, tenant_depth = tonumber(ARGV[10]), tonumber(ARGV[11])
local with_lead = ARGV[13] == '1'
local z = tonumber(ARGV[14]) or 0
local window_ttl = tonumber(ARGV[15])
local metrics = ARGV[16] == '1'
local version = redis.call('GET', KEYS[7]) or '0'

-- Usage (KEYS[6]) and totals (KEYS[9]) are listed in their index sets (KEYS[12], KEYS[13])
-- after each count, as every writer of theirs does (llmqueue/usage.py).
local function reject(reason, retry_after, rate, ahead, wait)
  redis.call('HINCRBY', KEYS[6], 'rejected_' .. reason, 1)
  redis.call('EXPIRE', KEYS[6], usage_ttl)
  redis.call('SADD', KEYS[12], KEYS[6])
  if metrics then
    redis.call('HINCRBY', KEYS[9], 'rejected_' .. reason, 1)
    redis.call('SADD', KEYS[13], KEYS[9])
    redis.call('HINCRBY', KEYS[10], 'rejected', 1)
    redis.call('EXPIRE', KEYS[10], window_ttl)
  end
  return {reason, tostring(retry_after), version, tostring(rate), ahead, tostring(wait or -1)}
end

-- The queue's drain rate (requests/s): an exponentially decayed count of claims over the equally
-- decayed time they were counted in (since: the first claim after the queue was last idle), so
-- a rate measured for less than a half-life is not biased low. Unknown (0) when nothing was
-- claimed for a while: a fresh or idle queue is not refused for being slow.
local rate = 0
local drain = redis.call('HMGET', KEYS[5], 'count', 'ts', 'since')
if drain[1] and now - tonumber(drain[2]) < 3 * tau then
  local span = math.max(MIN_DRAIN_SPAN, now - tonumber(drain[3] or (now - 100 * tau)))
  rate = tonumber(drain[1]) * math.exp(-(now - tonumber(drain[2])) / tau)
    / (tau * (1 - math.exp(-span / tau)))
end
-- Admitted requests between their decision and their publish count as queued already.
redis.call('ZREMRANGEBYSCORE', KEYS[11], '-inf', now - PUBLISH_GRACE)
local ahead = redis.call('LLEN', KEYS[3]) + redis.call('ZCARD', KEYS[11])

if redis.call('ZCOUNT', KEYS[4], '(' .. (now - stale), '+inf') == 0 then
  return reject('no_worker', -1, rate, ahead)
end
if ahead >= max_depth then
  return reject('queue_full', rate > 0 and (ahead - max_depth + 1) / rate or -1, rate, ahead)
end
-- Only requests due no later than this one go before it (deadline order within the queue).
local due = ahead
local dl = tonumber(ARGV[12])
if rate > 0 and dl and ahead > 0 then
  local newest = redis.call('LINDEX', KEYS[3], 0)
  if newest and deadline_of(newest) > dl then
    -- Past `need` due first it is too slow anyway; past WALK_LIMIT the FIFO estimate stands.
    local need = math.floor(rate * max_wait) + 1
    local side, n = boundary(KEYS[3], dl, math.min(need, WALK_LIMIT))
    if side == 'tail' then
      due = n
    elseif side == 'head' then
      due = ahead - n
    elseif need <= WALK_LIMIT then
      due = need
    end
  end
end
-- An empty queue is never too slow. Against a deadline, the mean wait decides (due / rate).
-- Against a first-token target, a quantile of the wait (z) does: behind a non-empty queue the
-- request leaves it at the (due + 1)-th claim (every slot is busy, its own must free too), so
-- its queue wait is Gamma(due + 1, rate) (claims as a Poisson process at the drain rate), and
-- then the engine's lead to the first token (its recent mean and variance). Their sum is taken
-- as the Gamma with the same mean and variance; Wilson-Hilferty gives its quantile at z.
local wait = rate > 0 and due / rate or 0
if with_lead and rate > 0 and due > 0 then
  local l = redis.call('HMGET', KEYS[5], 'lead_sum', 'lead_n', 'lead_sq', 'lead_b')
  local lead, lead_var = 0, 0
  local n = tonumber(l[2] or '0')
  if n > 0 then
    lead = tonumber(l[1]) / n
    local batches = tonumber(l[4] or '0')
    if batches > 1 then
      lead_var = math.max(0, (tonumber(l[3]) - lead * tonumber(l[1])) / (batches - 1))
    end
  end
  local mean = (due + 1) / rate + lead
  local var = (due + 1) / (rate * rate) + lead_var
  local shape = mean * mean / var
  local c = 1 - 1 / (9 * shape) + z / (3 * math.sqrt(shape))
  wait = mean * c * c * c
end
if rate > 0 and due > 0 and wait > max_wait then
  return reject('too_slow', wait - max_wait, rate, due, wait)
end
local mine = tonumber(redis.call('GET', KEYS[8]) or '0')
if mine >= tenant_depth then
  return reject('tenant_share', rate > 0 and (mine - tenant_depth + 1) / rate or -1, rate, ahead)
end

local b = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local requests = burst
if b[1] then
  requests = math.min(burst, tonumber(b[1]) + math.max(0, now - tonumber(b[2])) * rps)
end
if requests < 1 then
  return reject('rate', (1 - requests) / rps, rate, ahead)
end
local per_s = tpm / 60
local t = redis.call('HMGET', KEYS[2], 'tokens', 'ts')
local tokens = tpm
if t[1] then
  tokens = math.min(tpm, tonumber(t[1]) + math.max(0, now - tonumber(t[2])) * per_s)
end
if tokens < need then
  return reject('tokens', (need - tokens) / per_s, rate, ahead)
end

redis.call('HSET', KEYS[1], 'tokens', tostring(requests - 1), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil(burst / rps) + 60)
redis.call('HSET', KEYS[2], 'tokens', tostring(tokens - need), 'ts', tostring(now),
           'cap', tostring(tpm))
redis.call('EXPIRE', KEYS[2], 3600)
redis.call('INCR', KEYS[8])
redis.call('EXPIRE', KEYS[8], usage_ttl)
if ARGV[17] ~= '' then
  redis.call('ZADD', KEYS[11], now, ARGV[17])
  redis.call('EXPIRE', KEYS[11], PUBLISH_GRACE)
end
redis.call('HINCRBY', KEYS[6], 'admitted', 1)
redis.call('EXPIRE', KEYS[6], usage_ttl)
redis.call('SADD', KEYS[12], KEYS[6])
if metrics then
  redis.call('HINCRBY', KEYS[9], 'admitted', 1)
  redis.call('SADD', KEYS[13], KEYS[9])
  redis.call('HINCRBY', KEYS[10], 'admitted', 1)
  redis.call('EXPIRE', KEYS[10], window_ttl)
end
return {'', '0', version, tostring(rate), ahead, '-1'}
"""
)


@dataclass(frozen=True)
class Limits:
    """What one admission decision checks, from the cached Caller and route."""

    tenant_id: int
    tier_id: int
    queue: str
    pool: str
    requests_per_second: float
    burst: int
    tokens_per_minute: int
    max_queue_depth: int
    max_tier_share: float
    max_wait_seconds: float  # the request's own deadline window (its tier's max wait or tighter)
    own_deadline: bool = False  # tighter than the tier's: only requests due first count ahead
    first_token_target_seconds: float | None = None  # the tier's SLO, if it sheds at it
    wait_quantile: float = 0.5  # of the wait to a first token, what must meet the target

    @property
    def sheds_at_target(self) -> bool:
        target = self.first_token_target_seconds
        return target is not None and 0 < target < self.max_wait_seconds

    @property
    def acceptable_wait_seconds(self) -> float:
        """The longest estimated wait this request is admitted with: the first-token target (for
        the wait's `wait_quantile`), else the deadline (for the mean wait for an engine)."""
        if self.sheds_at_target:
            return float(self.first_token_target_seconds or 0)
        return self.max_wait_seconds


@dataclass(frozen=True)
class Decision:
    """An admission decision. `reason` is empty when admitted; `retry_after_seconds` is None
    when no wait can be estimated (no worker, or no drain rate measured yet).
    `estimated_wait_seconds` is the wait a too_slow refusal was judged by (else None)."""

    reason: str
    retry_after_seconds: float | None
    config_version: str
    drain_rate_per_second: float
    ahead: int
    estimated_wait_seconds: float | None = None

    @property
    def admitted(self) -> bool:
        return not self.reason


@cache
def _script() -> Any:
    return get_redis().register_script(_ADMIT)


@cache
def quantile_z(quantile: float) -> float:
    """The standard normal's quantile: Wilson-Hilferty turns it into the wait's."""
    return NormalDist().inv_cdf(quantile)


def _deadline_arg(limits: Limits, now: float | None) -> str:
    """The request's deadline (epoch seconds, this host's clock like the messages' deadlines)
    when it is tighter than its tier's and deadline order is on; else '' (FIFO: all ahead)."""
    if not (limits.own_deadline and settings.LLMQUEUE_EDF_WITHIN_TIER):
        return ""
    return repr((time.time() if now is None else now) + limits.max_wait_seconds)


def admit(limits: Limits, tokens: int, now: float | None = None, request_id: str = "") -> Decision:
    """Decide one request needing `tokens` (prompt estimate + max_tokens), atomically against
    every other replica; an admitted `request_id` counts in its queue's depth until published.
    `now` (epoch seconds) is for tests; by default Redis' clock decides, so
    replicas with skewed clocks share one timeline."""
    keys = [
        bucket_key("requests", limits.tenant_id),
        bucket_key("tokens", limits.tenant_id),
        limits.queue,
        liveness.pool_key(limits.pool),
        drain_key(limits.queue),
        usage.counter_key(limits.tenant_id, limits.tier_id, now),
        CONFIG_VERSION_KEY,
        waiting_key(limits.queue, limits.tenant_id),
        totals_key(limits.tenant_id, limits.tier_id),
        admissions_window_key(
            limits.tier_id, latency.minute_of(time.time() if now is None else now)
        ),
        publishing_key(limits.queue),
        USAGE_INDEX_KEY,
        TOTALS_INDEX_KEY,
    ]
    tenant_depth = max(1, math.floor(limits.max_queue_depth * limits.max_tier_share))
    args = [
        now_arg(now),
        limits.requests_per_second,
        limits.burst,
        limits.tokens_per_minute,
        tokens,
        limits.max_queue_depth,
        limits.acceptable_wait_seconds,
        settings.LLMQUEUE_WORKER_STALE_SECONDS,
        drain_tau_seconds(),
        usage.COUNTER_TTL_SECONDS,
        tenant_depth,
        _deadline_arg(limits, now),
        "1" if limits.sheds_at_target else "",
        quantile_z(limits.wait_quantile),
        latency.WINDOW_TTL_SECONDS,
        "1" if settings.LLMQUEUE_METRICS else "",
        request_id,
    ]
    reason, retry, version, rate, ahead, wait = _script()(keys=keys, args=args)
    retry_after, estimate = float(retry), float(wait)
    return Decision(
        reason=_text(reason),
        retry_after_seconds=None if retry_after < 0 else retry_after,
        config_version=_text(version),
        drain_rate_per_second=float(rate),
        ahead=int(ahead),
        estimated_wait_seconds=None if estimate < 0 else estimate,
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
