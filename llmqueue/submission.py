"""Submission: a validated prompt becomes a queued row and, once committed, a Celery task."""

from __future__ import annotations

import logging
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from llmqueue.auth import Caller
from llmqueue.errors import Unavailable
from llmqueue.models import PromptRequest
from llmqueue.payload import TaskPayload
from llmqueue.publisher import publish_task
from llmqueue.routing import ModelRoute, queue_name
from llmqueue.tasks import GENERATE_TASK
from llmqueue.validation import PromptSpec

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


def publish(row: PromptRequest, route: ModelRoute, caller: Caller) -> None:
    """Send the row's task to its (pool, tier) queue; the worker drops it after the deadline."""
    publish_task(
        GENERATE_TASK,
        str(row.id),
        queue_name(route.pool, caller.tier_name),
        [task_payload(row, caller.tier_priority)],
        expires=row.deadline_at,
        # The request id says enough: prompts stay out of message headers, Flower and events.
        argsrepr=f"({row.id})",
    )


def mark_unpublished(row: PromptRequest, error: Exception) -> None:
    PromptRequest.objects.filter(pk=row.pk, status=PromptRequest.Status.QUEUED).update(
        status=PromptRequest.Status.FAILED,
        finished_at=timezone.now(),
        error=f"not enqueued: broker unavailable ({error})",
    )


def submit_prompt(caller: Caller, route: ModelRoute, spec: PromptSpec) -> PromptRequest:
    """Store the request as queued and publish it once the row is committed.

    Publishing after commit means a worker never sees an id the DB does not have yet. If the broker
    refuses the publish, the row is marked failed and the caller gets 503: nothing is stranded as
    "queued" without a message.
    """
    now = timezone.now()
    row = PromptRequest(
        tenant_id=caller.tenant_id,
        tier_id=caller.tier_id,
        model=route.name,
        kind=spec.kind,
        prompt=spec.prompt,
        messages=spec.messages,
        params=spec.params,
        enqueued_at=now,
        deadline_at=now + timedelta(seconds=caller.max_wait_seconds),
    )
    try:
        with transaction.atomic():
            row.save(force_insert=True)
            transaction.on_commit(lambda: publish(row, route, caller))
    except Exception as exc:  # the broker refused the publish after the commit
        if row._state.adding:
            raise
        log.exception("publish of %s failed", row.id)
        mark_unpublished(row, exc)
        raise Unavailable(
            "The queue is unavailable; retry shortly.", retry_after_seconds=5
        ) from exc
    return row
