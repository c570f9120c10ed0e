"""Readers of a key family (dead workers, usage counters, /metrics totals) take its index set, not
a SCAN of a keyspace that holds a day of result keys; keys an older version wrote unlisted are
still found."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from contract import key_index, liveness
from contract.keys import (
    TOTALS_INDEX_KEY,
    USAGE_INDEX_KEY,
    USAGE_PREFIX,
    WORKERS_INDEX_KEY,
    totals_key,
    usage_key,
    workers_key,
)
from llmqueue import accounting, lua, usage
from llmqueue.admission import bulk_release, decision
from llmqueue.lifecycle import Ended
from llmqueue.metrics.readings import read_totals
from llmqueue.models import TenantUsage
from tests.conftest import Seeded

pytestmark = pytest.mark.django_db(transaction=True)
RESULT_KEYS = 3000  # a day of result keys, scaled down: what a SCAN would walk


@pytest.fixture
def crowded(live: redis.Redis) -> redis.Redis:
    """The live Redis database with many result keys in it, as broker and backend share it."""
    pipe = live.pipeline(transaction=False)
    for i in range(RESULT_KEYS):
        pipe.set(f"celery-task-meta-{uuid.UUID(int=i)}", "{}", ex=600)
    pipe.execute()
    return live


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """SCAN calls from now on, by any client of this process; each process's first read of an
    index walks once (forgotten here, so the test sees it)."""
    calls: list[int] = []
    real = redis.Redis.scan

    def counted(self: redis.Redis, *args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "scan", counted)
    key_index.forget_walks()
    yield calls
    key_index.forget_walks()


def usage_limits(seeded: Seeded) -> decision.Limits:
    return decision.Limits(
        tenant_id=seeded.tenant_id, tier_id=seeded.tier_id, pool="default",
        queue="default.interactive", requests_per_second=100, burst=2,
        tokens_per_minute=10**6, max_queue_depth=100, max_tier_share=1.0, max_wait_seconds=60,
    )  # fmt: skip


def test_dead_workers_usage_and_totals_are_read_from_their_indexes_without_a_scan(
    seeded: Seeded, crowded: redis.Redis, scans: list[int]
):
    tenant_id, tier_id = seeded.tenant_id, seeded.tier_id
    now = time.time()
    liveness.beat(crowded, "gpu-a", "w-dead", now=now - 100)
    liveness.beat(crowded, "gpu-a", "w-live", now=now)
    liveness.beat(crowded, "gpu-b", "w-gone", now=now - 100)
    for _ in range(3):  # admitted, admitted, rejected for its rate (burst 2)
        decision.admit(usage_limits(seeded), 5, now=now)
    assert bulk_release.take_tokens(tenant_id, tier_id, "default.batch", 10**6, [4, 4], now) == 2
    pipe = crowded.pipeline(transaction=False)
    done = Ended(uuid.UUID(int=1), tenant_id, tier_id, "default.interactive", "succeeded", 5, 2, 3)
    accounting.settle(pipe, [done])
    lua.execute(pipe)
    # Each reader walks once in this process (keys an older version left unlisted), no more.
    liveness.stale_workers(crowded, 30, now=now)
    read_totals(crowded, {}, {})
    key_index.members(crowded, USAGE_INDEX_KEY, f"{USAGE_PREFIX}:*")
    walks = len(scans)
    scans.clear()

    assert liveness.stale_workers(crowded, 30, now=now) == [
        ("gpu-a", "w-dead"),
        ("gpu-b", "w-gone"),
    ]
    totals = read_totals(crowded, {tier_id: "interactive"}, {tenant_id: "acme"})
    assert {k: v for k, v in totals.items() if k[2] in ("admitted", "rejected_rate")} == {
        ("interactive", "acme", "admitted"): 4,
        ("interactive", "acme", "rejected_rate"): 1,
    }
    assert usage.flush(crowded) == 1
    row = TenantUsage.objects.get()
    assert (row.admitted, row.rejected_rate, row.succeeded) == (4, 1, 1)
    assert (row.prompt_tokens, row.completion_tokens) == (2, 3)
    assert scans == []
    assert walks >= 3  # the three first reads walked (RESULT_KEYS / 1000 calls each, or more)
    assert crowded.smembers(USAGE_INDEX_KEY) == set()  # flushed keys leave their index
    assert crowded.smembers(TOTALS_INDEX_KEY) == {totals_key(tenant_id, tier_id).encode()}
    assert crowded.smembers(WORKERS_INDEX_KEY) == {
        workers_key(pool).encode() for pool in ("default", "gpu-a", "gpu-b")
    }


def test_keys_an_older_version_wrote_unlisted_are_found_by_a_process_first_read(
    seeded: Seeded, crowded: redis.Redis, scans: list[int]
):
    tenant_id, tier_id = seeded.tenant_id, seeded.tier_id
    now = time.time()
    old_usage = usage_key(tenant_id, tier_id, usage.hour_of(now))
    crowded.zadd(workers_key("gpu-old"), {"w-old": now - 100})
    crowded.hincrby(old_usage, "admitted", 7)
    crowded.hincrby(totals_key(tenant_id, tier_id), "admitted", 7)

    assert liveness.stale_workers(crowded, 30, now=now) == [("gpu-old", "w-old")]
    assert read_totals(crowded, {tier_id: "interactive"}, {tenant_id: "acme"}) == {
        ("interactive", "acme", "admitted"): 7
    }
    assert usage.flush(crowded) == 1
    assert TenantUsage.objects.get().admitted == 7
    assert len(scans) >= 3
    assert crowded.smembers(WORKERS_INDEX_KEY) == {
        workers_key(pool).encode() for pool in ("default", "gpu-old")
    }
    assert crowded.smembers(TOTALS_INDEX_KEY) == {totals_key(tenant_id, tier_id).encode()}
    assert crowded.smembers(USAGE_INDEX_KEY) == set()


def test_a_count_that_lands_between_a_flush_and_its_listing_is_flushed_with_the_next_one(
    seeded: Seeded, live: redis.Redis
):
    tenant_id, tier_id = seeded.tenant_id, seeded.tier_id
    key = usage.counter_key(tenant_id, tier_id)
    live.hincrby(key, "succeeded", 1)  # a writer's increment, its SADD not sent yet
    live.sadd(USAGE_INDEX_KEY, key)
    assert usage.flush(live) == 1
    live.hincrby(key, "succeeded", 1)  # the next increment, flushed before it is listed
    assert usage.flush(live) == 0
    live.sadd(USAGE_INDEX_KEY, key)  # listed: the next flush takes it
    pipe = live.pipeline(transaction=False)
    usage.count(pipe, tenant_id, tier_id, {"succeeded": 1})
    pipe.execute()
    assert usage.flush(live) == 1
    assert TenantUsage.objects.get().succeeded == 3
    assert live.smembers(USAGE_INDEX_KEY) == set()
