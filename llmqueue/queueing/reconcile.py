"""The reconciler: republishes queued requests whose broker message is gone (Redis lost its data).

The database is the source of truth for what was accepted. A row stays `queued` from its commit
until a worker claims it; its message is meanwhile in its queue's list or, delivered, in kombu's
`unacked` hash. If Redis restarts without its data (no AOF, a failover to a replica that had not
received the writes, a pacer or API killed between its commit and its publish), rows are left
queued with no message, and nothing would ever run them: they would wait out their deadline.

Each pass reads the queued rows older than a grace period, then the queues they belong to and
the unacked hash, and republishes a row only when its message was missing in two passes at least
LLMQUEUE_RECONCILE_CONFIRM_SECONDS apart and the row is still queued: a message between a worker's
BRPOP and its unacked write, or a publish in flight, is absent from one scan only. A republish is
never needed for a running row (crash recovery, workers/rescue.py, owns those), and a spurious
one could only start an attempt the claim then lets win over a live one: hence the confirmation.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterable
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.utils import timezone

from contract.keys import RECONCILED_KEY
from contract.task import GENERATE_TASK
from llmqueue.models import PromptRequest, Tier
from llmqueue.queueing.publisher import publish_tasks
from llmqueue.queueing.submission import rows_message
from llmqueue.redis_client import get_redis

log = logging.getLogger(__name__)
S = PromptRequest.Status
_UUID_CHARS = 36


def request_ids_in(message: object) -> list[str]:
    """The request ids a decoded task message carries, from its `argsrepr` header ("(id, id,
    …)"): the header says it without decoding the body, and holds no prompt."""
    try:
        argsrepr = str(message["headers"].get("argsrepr") or "")  # type: ignore[index]
    except (KeyError, TypeError, AttributeError):
        return []
    return [part for part in argsrepr.strip("()").split(", ") if len(part) == _UUID_CHARS]


def _decoded(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def messages_present(client: redis.Redis, queues: Iterable[str]) -> set[str]:
    """Every request id with a message waiting in `queues` or delivered and unacked."""
    pipe = client.pipeline(transaction=False)
    for queue in queues:
        pipe.lrange(queue, 0, -1)
    pipe.hvals("unacked")
    *waiting, unacked = pipe.execute()
    present: set[str] = set()
    for messages in waiting:
        for raw in messages:
            present.update(request_ids_in(_decoded(raw)))
    for raw in unacked:
        # kombu keeps [message, exchange, routing key] per delivery tag.
        delivery = _decoded(raw)
        if isinstance(delivery, list) and delivery:
            present.update(request_ids_in(delivery[0]))
    return present


def queued_candidates(now: datetime, limit: int) -> list[PromptRequest]:
    """Queued rows past the grace period and before their deadline, oldest first."""
    grace = timedelta(seconds=settings.LLMQUEUE_RECONCILE_GRACE_SECONDS)
    rows = PromptRequest.objects.filter(
        status=S.QUEUED, enqueued_at__lte=now - grace, deadline_at__gt=now
    ).order_by("enqueued_at")
    return list(rows[:limit])


class Reconciler:
    """One replica's reconciler; its suspects (rows missing from one scan) live between passes."""

    def __init__(self) -> None:
        self.suspects: dict[uuid.UUID, float] = {}
        self.last_pass = 0.0

    def due(self, clock: float) -> bool:
        return clock - self.last_pass >= settings.LLMQUEUE_RECONCILE_INTERVAL_SECONDS

    def run_once(self, now: datetime | None = None, clock: float | None = None) -> int:
        """One pass; returns how many requests it republished."""
        now = now or timezone.now()
        clock = time.monotonic() if clock is None else clock
        self.last_pass = clock
        rows = queued_candidates(now, settings.LLMQUEUE_RECONCILE_BATCH)
        if not rows:
            self.suspects.clear()
            return 0
        present = messages_present(get_redis(), {row.queue for row in rows})
        missing = {row.id: row for row in rows if str(row.id) not in present}
        confirm = settings.LLMQUEUE_RECONCILE_CONFIRM_SECONDS
        confirmed = [
            row
            for request_id, row in missing.items()
            if clock - self.suspects.get(request_id, clock) >= confirm
        ]
        self.suspects = {i: self.suspects.get(i, clock) for i in missing}
        still_queued = set(
            PromptRequest.objects.filter(
                pk__in=[row.id for row in confirmed], status=S.QUEUED
            ).values_list("id", flat=True)
        )
        rows = [row for row in confirmed if row.id in still_queued]
        if not rows:
            return 0
        republish(rows)
        for row in rows:
            self.suspects.pop(row.id, None)
        return len(rows)


def republish(rows: list[PromptRequest]) -> None:
    """Publish the rows' messages anew, one each, and count them."""
    priorities = dict(
        Tier.objects.filter(pk__in={row.tier_id for row in rows}).values_list("pk", "priority")
    )
    messages = [rows_message([row], priorities.get(row.tier_id, 0)) for row in rows]
    publish_tasks(GENERATE_TASK, messages)
    get_redis().incrby(RECONCILED_KEY, len(rows))
    log.warning(
        "republished %d queued requests whose messages were missing from the broker: %s",
        len(rows),
        ", ".join(str(row.id) for row in rows[:20]),
    )
