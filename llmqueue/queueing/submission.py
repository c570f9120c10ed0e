"""Submission: a validated prompt becomes a queued row and, once committed, a Celery task."""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db import DatabaseError, transaction
from django.utils import timezone

from contract.task import GENERATE_TASK, TaskPayload
from llmqueue import lifecycle_events, lua
from llmqueue.accounting import settle
from llmqueue.api.auth import Caller
from llmqueue.api.errors import Unavailable
from llmqueue.api.validation import PromptSpec, wait_seconds
from llmqueue.lifecycle import Ended
from llmqueue.models import PromptRequest
from llmqueue.queueing.lanes import queue_name
from llmqueue.queueing.publisher import TaskMessage, publish_tasks
from llmqueue.queueing.publishing import clear
from llmqueue.queueing.routing import ModelRoute
from llmqueue.queueing.row_insert import insert_request
from llmqueue.redis_client import get_redis

log = logging.getLogger(__name__)


def task_payload(row: PromptRequest, priority: int) -> TaskPayload:
    return {
        "request_id": str(row.id),
        "kind": row.kind,
        "model": row.model,
        "prompt": row.prompt,
        "messages": row.messages,
        "params": row.params,
        "priority": priority,
        "deadline_ts": row.deadline_at.timestamp(),
    }


def rows_message(rows: list[PromptRequest], priority: int) -> TaskMessage:
    """Stored rows of one queue as one task message (the bulk pacer's release of held lines, the
    reconciler's republish of a lost one): its task id is the first row's, its argsrepr lists
    every request id, and it expires at the earliest deadline among them."""
    return TaskMessage(
        str(rows[0].id),
        rows[0].queue,
        [[task_payload(row, priority) for row in rows]],
        expires=min(row.deadline_at for row in rows),
        argsrepr=f"({', '.join(str(row.id) for row in rows)})",
    )


def chunks(rows: list[PromptRequest], size: int) -> list[list[PromptRequest]]:
    return [rows[i : i + size] for i in range(0, len(rows), max(1, size))]


def publish(
    rows: list[PromptRequest],
    route: ModelRoute,
    caller: Caller,
    chunk_size: int,
    admitted: bool = False,
) -> None:
    """Send the rows' tasks to their (pool, tier) queue, `chunk_size` requests per message; the
    worker drops a message after its deadline. A message's task id is its first request's id."""
    queue = queue_name(route.pool, caller.tier_name)
    publish_tasks(
        GENERATE_TASK,
        [
            TaskMessage(
                str(chunk[0].id),
                queue,
                [[task_payload(row, caller.tier_priority) for row in chunk]],
                expires=min(row.deadline_at for row in chunk),
                # The request ids say enough: prompts stay out of headers, Flower and events.
                argsrepr=f"({', '.join(str(row.id) for row in chunk)})",
                by_deadline=any(has_own_deadline(row, caller) for row in chunk),
                publishing_ids=tuple(str(row.id) for row in chunk) if admitted else (),
            )
            for chunk in chunks(rows, chunk_size)
        ],
    )


def mark_unpublished(rows: list[PromptRequest], error: Exception, admitted: bool = False) -> None:
    PromptRequest.objects.filter(
        pk__in=[row.pk for row in rows], status=PromptRequest.Status.QUEUED
    ).update(
        status=PromptRequest.Status.FAILED,
        finished_at=timezone.now(),
        error=f"not enqueued: broker unavailable ({error})",
    )
    release_books(rows, admitted)


def release_books(rows: list[PromptRequest], admitted: bool = False) -> None:
    """Admitted requests that will never reach a queue: the tokens they reserved go back, they
    count as failed, not as waiting, and (`admitted`) no longer in their queue's depth."""
    ended = [
        Ended(row.id, row.tenant_id, row.tier_id, row.queue, "failed", row.reserved_tokens,
              was_waiting=True)
        for row in rows
    ]  # fmt: skip
    try:
        pipe = get_redis().pipeline(transaction=False)
        settle(pipe, ended)
        for row in rows if admitted else []:
            clear(pipe, row.queue, [row.id])
        lua.execute(pipe)
    except redis.RedisError:
        log.warning("could not settle the books of %d unqueued requests", len(rows))


def new_request(
    caller: Caller,
    route: ModelRoute,
    spec: PromptSpec,
    now: datetime,
    reserved_tokens: int = 0,
    request_id: uuid.UUID | None = None,
) -> PromptRequest:
    return PromptRequest(
        id=request_id or uuid.uuid4(),
        reserved_tokens=reserved_tokens,
        queue=queue_name(route.pool, caller.tier_name),
        tenant_id=caller.tenant_id,
        tier_id=caller.tier_id,
        model=route.name,
        kind=spec.kind,
        prompt=spec.prompt,
        messages=spec.messages,
        params=spec.params,
        enqueued_at=now,
        deadline_at=now + timedelta(seconds=wait_seconds(spec, caller)),
    )


def has_own_deadline(row: PromptRequest, caller: Caller) -> bool:
    """The request asked for a tighter deadline than its tier's max wait."""
    return row.deadline_at < row.enqueued_at + timedelta(seconds=caller.max_wait_seconds)


def submit_prompts(
    caller: Caller,
    route: ModelRoute,
    specs: list[PromptSpec],
    chunk_size: int = 1,
    reserved_tokens: int = 0,
    request_ids: list[uuid.UUID] | None = None,
) -> list[PromptRequest]:
    """Store the requests as queued, in one transaction, and publish them once it committed (one
    broker round trip for all: a bulk job's prompts cost a few statements, not one per prompt).
    A bulk job packs `chunk_size` requests per task message: the worker's per-message cost
    (Celery's delivery, unacked bookkeeping, ack) is then paid once per chunk; each request still
    has its own row, claim and result.

    Publishing after commit means a worker never sees an id the DB does not have yet. If the broker
    refuses the publish, the rows are marked failed and the caller gets 503: nothing is stranded
    as "queued" without a message. If the database refuses the rows, the caller gets 503 too and
    the admission's reservations are released.

    `request_ids`: the ids admission counted in the queue's depth (one per spec); the publish
    stops counting them as it queues them (llmqueue/queueing/publishing.py).
    """
    now = timezone.now()
    ids: list[uuid.UUID | None] = list(request_ids) if request_ids else [None] * len(specs)
    rows = [
        new_request(caller, route, spec, now, reserved_tokens, request_id)
        for spec, request_id in zip(specs, ids, strict=True)
    ]
    admitted = request_ids is not None
    committed = False

    def publish_committed() -> None:
        nonlocal committed
        committed = True
        publish(rows, route, caller, chunk_size, admitted)

    try:
        if len(rows) == 1 and transaction.get_autocommit():
            # One row needs no transaction: the INSERT commits by itself, and on_commit outside
            # a transaction runs at once. BEGIN + COMMIT would cost two more DB round trips on
            # every API request.
            insert_request(rows[0])
            transaction.on_commit(publish_committed)
        else:
            with transaction.atomic():
                PromptRequest.objects.bulk_create(rows)
                transaction.on_commit(publish_committed)
    except Exception as exc:
        if not committed:
            release_books(rows, admitted)
            if isinstance(exc, DatabaseError):
                raise Unavailable(
                    "The database is unavailable; nothing was queued. Retry shortly.",
                    retry_after_seconds=5,
                ) from exc
            raise
        log.exception("publish of %d requests failed", len(rows))
        mark_unpublished(rows, exc, admitted)
        raise Unavailable(
            "The queue is unavailable; retry shortly.", retry_after_seconds=5
        ) from exc
    lifecycle_events.log_admitted(rows, caller.tenant_name, settings.LLMQUEUE_EVENT_LOG_TEXT)
    return rows


def submit_prompt(
    caller: Caller,
    route: ModelRoute,
    spec: PromptSpec,
    reserved_tokens: int = 0,
    request_id: uuid.UUID | None = None,
) -> PromptRequest:
    """Store one admitted request (holding `reserved_tokens` of its tenant's tokens per minute;
    `request_id` the id admission counted it under) as queued and publish it once committed."""
    ids = None if request_id is None else [request_id]
    rows = submit_prompts(caller, route, [spec], reserved_tokens=reserved_tokens, request_ids=ids)
    return rows[0]
