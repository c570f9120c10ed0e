"""Celery tasks: thin wrappers that hand the work to llmqueue.execution."""

from __future__ import annotations

import uuid
from typing import Any

from celery import shared_task
from celery.signals import task_revoked
from django.utils import timezone

from llmqueue import lifecycle
from llmqueue.execution import run_prompt
from llmqueue.payload import TaskPayload

GENERATE_TASK = "llmqueue.generate"


@shared_task(bind=True, name=GENERATE_TASK, acks_late=True)
def generate(self: Any, payload: TaskPayload) -> dict[str, Any]:
    def mark_expired(request_id: str) -> None:
        self.backend.mark_as_revoked(request_id, reason="expired", request=self.request)

    return run_prompt(payload, worker=self.request.hostname or "", mark_expired=mark_expired)


@task_revoked.connect
def on_revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    """Celery drops a message past its `expires` before running it: record that in the row."""
    if expired and request is not None and getattr(sender, "name", None) == GENERATE_TASK:
        lifecycle.expire([uuid.UUID(request.id)], timezone.now())
