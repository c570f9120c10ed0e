"""Per-tenant, per-tier usage: counted in Redis on the hot paths, moved into TenantUsage rows.

Admission counts admissions and rejections by reason inside its one script, and a worker's
recorder counts outcomes and tokens in the pipeline that publishes them: no round trip of its own.
`flush` moves the counters into hourly TenantUsage rows (each key read and deleted atomically, so
any number of flushers may run at once): workers flush every few seconds, the admin's usage page
before it reads. Every writer lists its key in USAGE_INDEX_KEY after its increments (a flush
between the two finds a listed name with nothing left, or takes the increment with the key), and
`flush` reads that list, not the keyspace (contract/key_index.py).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import F

from contract import key_index
from contract.keys import TOTALS_INDEX_KEY, USAGE_INDEX_KEY, USAGE_PREFIX, totals_key, usage_key
from llmqueue.models import TenantUsage
from llmqueue.redis_client import get_redis

COUNTER_TTL_SECONDS = 7 * 24 * 3600
"""How long an unflushed hour of counters survives in Redis (no flusher running meanwhile)."""

FIELDS = frozenset(
    f.name for f in TenantUsage._meta.get_fields() if f.name not in ("id", "tenant", "tier", "hour")
)

# Read a counter hash, delete it and unlist it (KEYS[2], the index) in one step: two flushers
# never count the same hit twice.
_TAKE = """
local fields = redis.call('HGETALL', KEYS[1])
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], KEYS[1])
return fields
"""


def hour_of(epoch: float) -> int:
    return int(epoch // 3600 * 3600)


def counter_key(tenant_id: int, tier_id: int, now: float | None = None) -> str:
    hour = hour_of(time.time() if now is None else now)
    return usage_key(tenant_id, tier_id, hour)


def count(
    pipe: redis.client.Pipeline, tenant_id: int, tier_id: int, counts: dict[str, int]
) -> None:
    """Queue on `pipe` increments of usage fields (e.g. {"succeeded": 1, "prompt_tokens": 12}),
    in the hour's counters and in the never-flushed totals /metrics reads."""
    key, totals = counter_key(tenant_id, tier_id), totals_key(tenant_id, tier_id)
    counted = False
    for field, amount in counts.items():
        if amount:
            counted = True
            pipe.hincrby(key, field, amount)
            if settings.LLMQUEUE_METRICS:
                pipe.hincrby(totals, field, amount)
    pipe.expire(key, COUNTER_TTL_SECONDS)
    if counted:
        pipe.sadd(USAGE_INDEX_KEY, key)
        if settings.LLMQUEUE_METRICS:
            pipe.sadd(TOTALS_INDEX_KEY, totals)


def _parse_key(key: str) -> tuple[int, int, datetime]:
    tenant_id, tier_id, hour = key[len(USAGE_PREFIX) + 1 :].split(":")
    return int(tenant_id), int(tier_id), datetime.fromtimestamp(int(hour), tz=UTC)


def _keys(client: redis.Redis) -> list[str]:
    return key_index.members(client, USAGE_INDEX_KEY, f"{USAGE_PREFIX}:*")


def flush(client: redis.Redis | None = None) -> int:
    """Move every usage counter from Redis into TenantUsage rows; returns the rows touched."""
    client = client or get_redis()
    take = client.register_script(_TAKE)
    touched = 0
    for key in _keys(client):
        raw = take(keys=[key, USAGE_INDEX_KEY])
        counts = {
            _text(raw[i]): int(raw[i + 1]) for i in range(0, len(raw), 2) if _text(raw[i]) in FIELDS
        }
        if not counts:
            continue
        tenant_id, tier_id, hour = _parse_key(key)
        with transaction.atomic():
            row, _ = TenantUsage.objects.select_for_update().get_or_create(
                tenant_id=tenant_id, tier_id=tier_id, hour=hour
            )
            TenantUsage.objects.filter(pk=row.pk).update(
                **{field: F(field) + amount for field, amount in counts.items()}
            )
        touched += 1
    return touched


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def recent(tenant_id: int, hours: int) -> tuple[list[TenantUsage], dict[str, int]]:
    """A tenant's hourly usage rows of the last `hours` hours, newest first, and their totals."""
    since = datetime.fromtimestamp(hour_of(time.time()) - (hours - 1) * 3600, tz=UTC)
    rows = list(
        TenantUsage.objects.filter(tenant_id=tenant_id, hour__gte=since)
        .select_related("tier")
        .order_by("-hour", "tier__name")
    )
    totals = {field: sum(getattr(row, field) for row in rows) for field in sorted(FIELDS)}
    return rows, totals
