"""The bulk pacer's admission: take a tenant's tokens-per-minute for lines, in order, as far as
its bucket holds them; the same bucket, reservations and refunds as API calls (decision.py)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

from django.conf import settings

from contract.keys import (
    TOTALS_INDEX_KEY,
    USAGE_INDEX_KEY,
    bucket_key,
    totals_key,
    waiting_key,
)
from llmqueue import usage
from llmqueue.admission.books import LUA_NOW, now_arg
from llmqueue.redis_client import get_redis

# KEYS[1] the tenant's token bucket, KEYS[2] its waiting count in the queue, KEYS[3] its usage
# counters of this hour, KEYS[4] its totals for /metrics, KEYS[5] and KEYS[6] the index sets
# that list usage and totals keys (llmqueue/usage.py); ARGV: now, tokens per minute, the usage
# counters' ttl, "1" when metrics are on, then each line's need. Takes the longest prefix of lines
# that fits and counts it admitted, as admission counts an API call; returns its length. The
# refill is admission's: tpm/60 per second up to tpm.
_TAKE = (
    LUA_NOW
    + """
local tpm = tonumber(ARGV[2])
local t = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tpm
if t[1] then
  tokens = math.min(tpm, tonumber(t[1]) + math.max(0, now - tonumber(t[2])) * tpm / 60)
end
local taken = 0
for i = 5, #ARGV do
  local need = tonumber(ARGV[i])
  if need > tokens then break end
  tokens = tokens - need
  taken = taken + 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now), 'cap', tostring(tpm))
redis.call('EXPIRE', KEYS[1], 3600)
if taken > 0 then
  redis.call('INCRBY', KEYS[2], taken)
  redis.call('EXPIRE', KEYS[2], ARGV[3])
  redis.call('HINCRBY', KEYS[3], 'admitted', taken)
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  redis.call('SADD', KEYS[5], KEYS[3])
  if ARGV[4] == '1' then
    redis.call('HINCRBY', KEYS[4], 'admitted', taken)
    redis.call('SADD', KEYS[6], KEYS[4])
  end
end
return taken
"""
)


@cache
def _script() -> Any:
    return get_redis().register_script(_TAKE)


def take_tokens(
    tenant_id: int, tier_id: int, queue: str, tokens_per_minute: int, needs: Sequence[int],
    now: float | None = None,
) -> int:  # fmt: skip
    """Reserve `needs` in order while the bucket holds them; returns how many were reserved.
    Each one reserved counts as admitted (usage, /metrics) and as waiting in `queue` until a
    worker claims it, as an API call."""
    keys = [
        bucket_key("tokens", tenant_id),
        waiting_key(queue, tenant_id),
        usage.counter_key(tenant_id, tier_id, now),
        totals_key(tenant_id, tier_id),
        USAGE_INDEX_KEY,
        TOTALS_INDEX_KEY,
    ]
    metrics = "1" if settings.LLMQUEUE_METRICS else ""
    args = [now_arg(now), tokens_per_minute, usage.COUNTER_TTL_SECONDS, metrics, *needs]
    return int(_script()(keys=keys, args=args))


def available_tokens(tenant_id: int, tokens_per_minute: int, now: float | None = None) -> float:
    """What the tenant's bucket holds now (nothing taken): the pacer's plan, which take_tokens
    then makes good atomically."""
    tokens, ts = get_redis().hmget(bucket_key("tokens", tenant_id), "tokens", "ts")
    if tokens is None or ts is None:
        return float(tokens_per_minute)
    clock = now if now is not None else _server_time()
    refill = max(0.0, clock - float(ts)) * tokens_per_minute / 60
    return min(float(tokens_per_minute), float(tokens) + refill)


def _server_time() -> float:
    seconds, micros = get_redis().time()
    return float(seconds) + micros / 1e6
