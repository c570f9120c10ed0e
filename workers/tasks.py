"""The worker's Celery task: a thin wrapper that hands the work to workers/execution.py."""

from __future__ import annotations

import uuid
from typing import Any

from celery import shared_task
from celery.signals import task_revoked

from contract.task import GENERATE_IGNORE_RESULT, GENERATE_TASK, TaskPayload
from workers.execution import run_prompts
from workers.queue_order import drop_prestarts, take_holds
from workers.recorder import get_recorder


# A message carries one request (an API call) or a bulk job's chunk; the recorder publishes each
# request's outcome under the request's own id (contract.task.GENERATE_IGNORE_RESULT).
@shared_task(bind=True, name=GENERATE_TASK, acks_late=True, ignore_result=GENERATE_IGNORE_RESULT)
def generate(self: Any, payloads: list[TaskPayload]) -> None:
    run_prompts(payloads, worker=self.request.hostname or "")


@task_revoked.connect
def on_revoked(sender: Any = None, request: Any = None, expired: bool = False, **_: Any) -> None:
    """Celery drops a message past its `expires` before running it: the recorder marks the row
    expired and publishes that, off the consumer's event loop, unless the request was started
    at delivery (its claim expires an overdue row). Any revoked message gives its requests'
    places in the engine budget back."""
    if request is None or getattr(sender, "name", None) != GENERATE_TASK:
        return
    ids = [payload["request_id"] for payload in request.args[0]]
    unstarted = drop_prestarts(ids)  # a request started at delivery: its claim decides
    for hold in take_holds(ids):
        hold.release()
    if expired:
        for request_id in unstarted:
            get_recorder().expire(uuid.UUID(request_id))
