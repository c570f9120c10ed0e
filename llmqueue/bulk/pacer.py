"""The bulk pacer: releases held lines into the broker as each tenant's tokens per minute and
its tier's queue depth allow, fair between a tier's tenants by tokens; one replica at a time.

Every tick, for each (tier, queue) with held lines of running jobs, it fills the queue up to
LLMQUEUE_BULK_DEPTH_SHARE of the tier's max_queue_depth (the rest stays headroom for the tier's
API callers, whom admission refuses at the full depth), picking each next line from the tenant
with the least weighted service (llmqueue/admission/fairness.py), while that tenant's
tokens-per-minute bucket holds the line's prompt + max_tokens. A line released takes its
tokens from the same bucket as an API call and is refunded by the worker's books when it ends,
so a job larger than the quota or the depth is paced, never refused. A Redis lease makes exactly
one pacer release across API replicas; the others stand by.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Iterable
from datetime import datetime

import redis
from django.conf import settings
from django.db import close_old_connections, connection
from django.utils import timezone

from contract.keys import PREFIX, waiting_key
from contract.task import GENERATE_TASK
from llmqueue import lifecycle_events, lua
from llmqueue.admission import books
from llmqueue.admission.bulk_release import available_tokens, take_tokens
from llmqueue.admission.fairness import VirtualTokenCounter
from llmqueue.bulk.finalize import advance_jobs
from llmqueue.models import BulkJob, PromptRequest, Tenant, Tier
from llmqueue.queueing.publisher import publish_tasks
from llmqueue.queueing.reconcile import Reconciler
from llmqueue.queueing.submission import chunks, rows_message
from llmqueue.redis_client import get_redis

log = logging.getLogger(__name__)
S = PromptRequest.Status
LEASE_KEY = f"{PREFIX}:bulk-pacer:lease"
ENDED = (S.SUCCEEDED, S.FAILED, S.EXPIRED, S.CANCELLED)
# Ended lines are looked up by primary key, at most this many, this often: a bounded query.
CORRECT_INTERVAL_SECONDS, CORRECT_BATCH = 1.0, 2000
_TABLE = PromptRequest._meta.db_table
_HELD_FIELDS = (
    "id", "tenant_id", "tier_id", "queue", "kind", "model", "prompt", "messages", "params",
    "deadline_at", "enqueued_at", "reserved_tokens",
)  # fmt: skip

# KEYS[1] the lease; ARGV: this pacer's token, lease milliseconds. Renews a lease it holds,
# takes a free one; 1 when this pacer holds it now.
_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""


def requests_waiting(queue: str, tenant_ids: Iterable[int]) -> int:
    """Requests admitted to `queue` and not claimed yet, summed over tenants: counted in
    requests, where the queue's length counts messages (the pacer packs several lines in one)."""
    keys = [waiting_key(queue, tenant_id) for tenant_id in tenant_ids]
    return sum(int(v) for v in get_redis().mget(keys) if v) if keys else 0


def bulk_room(tier: Tier, queue: str) -> int:
    """How many more lines the queue takes now: up to the bulk share of the tier's depth."""
    cap = math.floor(tier.max_queue_depth * settings.LLMQUEUE_BULK_DEPTH_SHARE)
    tenants = Tenant.objects.values_list("id", flat=True)
    return max(0, cap - requests_waiting(queue, tenants))


def held_lines(tenant_id: int, tier_id: int, queue: str, limit: int) -> list[PromptRequest]:
    """A tenant's next held lines on a queue: its oldest running job's first, in input order."""
    rows = PromptRequest.objects.filter(
        status=S.HELD, tenant_id=tenant_id, tier_id=tier_id, queue=queue,
        job__status=BulkJob.Status.IN_PROGRESS,
    ).order_by("job__created_at", "line")  # fmt: skip
    return list(rows.only(*_HELD_FIELDS)[:limit])


def mark_released(ids: list[uuid.UUID], now: datetime) -> set[uuid.UUID]:
    """held → queued, for those still held (a cancel or expiry may have won); returns them."""
    if not ids:
        return set()
    field = PromptRequest._meta.get_field("id")
    db_ids = [field.get_db_prep_value(i, connection) for i in ids]
    enqueued = PromptRequest._meta.get_field("enqueued_at").get_db_prep_value(now, connection)
    marks = ", ".join(["%s"] * len(ids))
    sql = (
        f"UPDATE {_TABLE} SET status = %s, enqueued_at = %s "
        f"WHERE id IN ({marks}) AND status = %s RETURNING id"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, [S.QUEUED, enqueued, *db_ids, S.HELD])
        return {uuid.UUID(str(i)) for (i,) in cursor.fetchall()}


def give_back(rows: list[PromptRequest], queue: str) -> None:
    """Lines reserved but not published: their tokens and waiting counts go back."""
    by_tenant: dict[int, list[PromptRequest]] = defaultdict(list)
    for row in rows:
        by_tenant[row.tenant_id].append(row)
    pipe = get_redis().pipeline(transaction=False)
    for tenant_id, mine in by_tenant.items():
        books.refund(pipe, tenant_id, sum(r.reserved_tokens for r in mine))
        pipe.decrby(waiting_key(queue, tenant_id), len(mine))
    lua.execute(pipe)


class Pacer:
    """One replica's pacer; its fairness counters live as long as it holds the lease."""

    def __init__(self) -> None:
        self.counters: dict[int, VirtualTokenCounter] = {}
        self.token = uuid.uuid4().hex
        self._lease = get_redis().register_script(_LEASE)
        # Lines released and not yet seen ended: id → (tier, tenant, tokens charged at release).
        self.in_flight: dict[uuid.UUID, tuple[int, int, int]] = {}
        self._corrected_at = 0.0

    def hold_lease(self) -> bool:
        ms = int(settings.LLMQUEUE_BULK_PACER_LEASE_SECONDS * 1000)
        held = bool(self._lease(keys=[LEASE_KEY], args=[self.token, ms]))
        if not held:
            # Another replica serves; start afresh if this one takes over.
            self.counters.clear()
            self.in_flight.clear()
        return held

    def tick(self, now: datetime | None = None) -> int:
        """Charge ended lines what they used, release what fits, then move jobs on; returns the
        lines released."""
        if time.monotonic() - self._corrected_at >= CORRECT_INTERVAL_SECONDS:
            self.correct_ended()
        released = self.release_once(now)
        advance_jobs(now)
        return released

    def correct_ended(self) -> int:
        """A line is charged prompt + max_tokens when released; once it ended, charge what it
        used (prompt + generated tokens), so a tenant whose lines stop early is not charged for
        tokens never made. Returns how many lines were corrected."""
        self._corrected_at = time.monotonic()
        oldest = list(self.in_flight)[:CORRECT_BATCH]
        if not oldest:
            return 0
        ended = PromptRequest.objects.filter(pk__in=oldest, status__in=ENDED).values_list(
            "id", "prompt_tokens", "completion_tokens"
        )
        corrected = 0
        for request_id, prompt_tokens, completion_tokens in ended:
            tier_id, tenant_id, charged = self.in_flight.pop(request_id)
            counter = self.counters.get(tier_id)
            if counter is not None:
                used = (prompt_tokens or 0) + (completion_tokens or 0)
                counter.correct(tenant_id, charged, used)
                corrected += 1
        return corrected

    def release_once(self, now: datetime | None = None) -> int:
        now = now or timezone.now()
        backlog = (
            PromptRequest.objects.filter(status=S.HELD, job__status=BulkJob.Status.IN_PROGRESS)
            .order_by()
            .values_list("tier_id", "queue", "tenant_id")
            .distinct()
        )
        by_queue: dict[tuple[int, str], set[int]] = defaultdict(set)
        for tier_id, queue, tenant_id in backlog:
            by_queue[(tier_id, queue)].add(tenant_id)
        if not by_queue:
            return 0
        tiers = Tier.objects.in_bulk({tier for tier, _ in by_queue})
        tenants = Tenant.objects.in_bulk({t for ts in by_queue.values() for t in ts})
        return sum(
            self.release_queue(tiers[tier_id], queue, [tenants[t] for t in tenant_ids], now)
            for (tier_id, queue), tenant_ids in sorted(by_queue.items())
        )

    def release_queue(
        self, tier: Tier, queue: str, tenants: Iterable[Tenant], now: datetime
    ) -> int:
        room = bulk_room(tier, queue)
        if room <= 0:
            return 0
        tenants = list(tenants)
        counter = self.counters.setdefault(tier.pk, VirtualTokenCounter())
        counter.weights = {t.pk: t.weight for t in tenants}
        pending = {t.pk: deque(held_lines(t.pk, tier.pk, queue, room)) for t in tenants}
        left = {t.pk: available_tokens(t.pk, t.tokens_per_minute) for t in tenants}
        chosen: dict[int, list[PromptRequest]] = defaultdict(list)
        waiting = {t for t, lines in pending.items() if lines}
        while room > 0:
            tenant = counter.next_tenant(waiting)
            if tenant is None:
                break
            line = pending[tenant][0]
            if line.reserved_tokens > left[tenant]:
                waiting.discard(tenant)  # its quota is spent for now: not backlogged on ours
                continue
            pending[tenant].popleft()
            left[tenant] -= line.reserved_tokens
            counter.served(tenant, line.reserved_tokens)
            chosen[tenant].append(line)
            room -= 1
            if not pending[tenant]:
                waiting.discard(tenant)
        return self.publish(tier, queue, chosen, {t.pk: t for t in tenants}, counter, now)

    def publish(
        self,
        tier: Tier,
        queue: str,
        chosen: dict[int, list[PromptRequest]],
        tenants: dict[int, Tenant],
        counter: VirtualTokenCounter,
        now: datetime,
    ) -> int:
        reserved: list[PromptRequest] = []
        for tenant_id, lines in chosen.items():
            needs = [line.reserved_tokens for line in lines]
            tpm = tenants[tenant_id].tokens_per_minute
            taken = take_tokens(tenant_id, tier.pk, queue, tpm, needs)
            counter.correct(tenant_id, sum(needs[taken:]), 0)  # raced by the tenant's API calls
            reserved += lines[:taken]
        released = mark_released([row.id for row in reserved], now)
        give_back([row for row in reserved if row.id not in released], queue)
        rows = [row for row in reserved if row.id in released]
        try:
            for row in rows:
                row.enqueued_at = now
            size = settings.LLMQUEUE_BULK_LINES_PER_MESSAGE
            messages = [rows_message(chunk, tier.priority) for chunk in chunks(rows, size)]
            publish_tasks(GENERATE_TASK, messages)
            for row in rows:
                self.in_flight[row.id] = (tier.pk, row.tenant_id, row.reserved_tokens)
        except redis.RedisError:
            log.warning("broker refused %d bulk lines; they stay held", len(rows))
            PromptRequest.objects.filter(pk__in=[r.id for r in rows], status=S.QUEUED).update(
                status=S.HELD
            )
            give_back(rows, queue)
            return 0
        for tenant_id in chosen:
            mine = [row for row in rows if row.tenant_id == tenant_id]
            lifecycle_events.log_admitted(
                mine, tenants[tenant_id].name, settings.LLMQUEUE_EVENT_LOG_TEXT
            )
        return len(rows)


def run_pacer(stop: threading.Event, interval_seconds: float | None = None) -> None:
    """Tick until `stop` is set, releasing and finishing only while holding the lease; the
    lease holder also reconciles queued rows with the broker (llmqueue/queueing/reconcile.py)."""
    interval = interval_seconds or settings.LLMQUEUE_BULK_PACER_INTERVAL_SECONDS
    pacer, reconciler = Pacer(), Reconciler()
    while not stop.is_set():
        try:
            close_old_connections()
            if pacer.hold_lease():
                pacer.tick()
                if reconciler.due(time.monotonic()):
                    reconciler.run_once()
            else:
                reconciler.suspects.clear()
        except Exception:  # a lost broker or DB must not end the loop: the next tick retries
            log.exception("bulk pacer tick failed")
        stop.wait(interval)
    try:
        client = get_redis()
        if client.get(LEASE_KEY) == pacer.token.encode():
            client.delete(LEASE_KEY)
    except redis.RedisError:
        pass
