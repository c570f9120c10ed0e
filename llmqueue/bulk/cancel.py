"""Cancelling a bulk job: its held, queued and running lines, through the requests' own cancel.

Kept apart from job creation (which needs the API's validation) so the admin, loaded by every
process that sets Django up, the GPU worker's included, can cancel jobs without the HTTP layer.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime

import redis
from django.utils import timezone

from llmqueue import lifecycle
from llmqueue.cancellation import cancel_requests
from llmqueue.models import BulkJob, PromptRequest

log = logging.getLogger(__name__)
S = PromptRequest.Status
J = BulkJob.Status


def cancel_job(job: BulkJob, now: datetime | None = None) -> BulkJob:
    """Cancel a job: held lines never leave, queued ones never reach an engine, running ones
    are aborted in theirs (cancellation.cancel_requests); finished output is kept. The job is
    cancelling until none runs, then the finalizer makes it cancelled."""
    now = now or timezone.now()
    moved = BulkJob.objects.filter(pk=job.pk, status__in=[J.VALIDATING, J.IN_PROGRESS]).update(
        status=J.CANCELLING, cancelling_at=now
    )
    if moved:
        cancel_lines(job, now)
    job.refresh_from_db()
    return job


def cancel_lines(job: BulkJob, now: datetime) -> None:
    held = PromptRequest.objects.filter(job=job, status=S.HELD).values_list("id", flat=True)
    lifecycle.cancel_held(list(held), now)
    live = PromptRequest.objects.filter(job=job, status__in=[S.QUEUED, S.RUNNING])
    ids: list[uuid.UUID] = list(live.values_list("id", flat=True))
    for start in range(0, len(ids), 500):
        try:
            cancel_requests(ids[start : start + 500])
        except redis.RedisError:  # the rows are cancelled; workers learn it at their claim
            log.warning("batch %s cancelled, but Redis could not be told", job.id)
