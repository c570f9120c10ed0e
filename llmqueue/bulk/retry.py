"""Retrying a finished job's failed and expired lines as fresh held lines, for the pacer to release.

Which lines: `failed` (the engine or the worker failed them) and `expired` (the window or their
deadline ended them before an engine took them). Not `cancelled`: someone chose to stop those.
Which jobs: `completed` and `expired` ones; a cancelled job stays as its canceller left it, and
one failed at validation has no lines.

A retried line becomes a new held row of the job in the old one's place: same custom_id, input
line, prompt and parameters, nothing of its last try, and a new request id. A new id because the
id is the Celery task id: workers keep the ids of expired and revoked tasks in memory for hours
and would drop a message that reused one, and a late redelivery of the old try finds nothing to
claim. The job still has one row per input line, rendered once into its output or error file.
The job gets a new completion window from now (the retried lines' deadline), goes back to
in_progress and drops its rendered files; the pacer (manage.py bulk_pacer) releases the lines
as quotas allow, and renders the files anew when they are done.

Kept free of the HTTP layer: the admin, loaded in every process, calls it.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from llmqueue.models import BulkJob, PromptRequest, StoredFile

S = PromptRequest.Status
J = BulkJob.Status
RETRIED_LINES = (S.FAILED, S.EXPIRED)
RETRIED_JOBS = (J.COMPLETED, J.EXPIRED)
_LAST_TRY = {
    "status": S.HELD, "attempts": 0, "worker": "", "started_at": None, "first_token_at": None,
    "finished_at": None, "output_text": "", "finish_reason": "", "error": "",
    "prompt_tokens": None, "completion_tokens": None,
}  # fmt: skip
_CHUNK = 500  # ids per DELETE and rows per INSERT: far below every database's parameter limit


def retry_failed(job: BulkJob, now: datetime | None = None) -> int:
    """Replace `job`'s failed and expired lines with fresh held ones and put it back in
    progress; returns the lines retried (0, job untouched, when it is not completed or expired
    or has none to retry)."""
    now = now or timezone.now()
    expires_at = now + timedelta(seconds=window_seconds(job))
    with transaction.atomic():
        # Lines and job in one transaction: a pacer tick never sees the job in progress with
        # nothing held (it would finish it again at once) nor held lines of a finished job.
        rows = list(PromptRequest.objects.filter(job=job, status__in=RETRIED_LINES))
        if not rows:
            return 0
        moved = BulkJob.objects.filter(pk=job.pk, status__in=RETRIED_JOBS).update(
            status=J.IN_PROGRESS, expires_at=expires_at, in_progress_at=now,
            finalizing_at=None, completed_at=None, expired_at=None,
            output_file=None, error_file=None,
        )  # fmt: skip
        if not moved:
            return 0
        old_ids = [row.pk for row in rows]
        for start in range(0, len(old_ids), _CHUNK):
            PromptRequest.objects.filter(pk__in=old_ids[start : start + _CHUNK]).delete()
        fresh = [fresh_line(row, expires_at) for row in rows]
        PromptRequest.objects.bulk_create(fresh, batch_size=_CHUNK)
        stale = [f for f in (job.output_file_id, job.error_file_id) if f]
        transaction.on_commit(lambda: drop_files(stale))
    job.refresh_from_db()
    return len(fresh)


def fresh_line(row: PromptRequest, deadline: datetime) -> PromptRequest:
    """`row` as a new held line: a new id, its deadline, nothing of its last try."""
    row.pk = uuid.uuid4()
    for field, value in _LAST_TRY.items():
        setattr(row, field, value)
    row.deadline_at = deadline
    return row


def window_seconds(job: BulkJob) -> int:
    windows: dict[str, int] = settings.LLMQUEUE_BULK_COMPLETION_WINDOWS
    return windows.get(job.completion_window, max(windows.values()))


def drop_files(file_ids: list[str]) -> None:
    """The job's rendered output and error files: they describe the try that was retried."""
    for stored in StoredFile.objects.filter(pk__in=file_ids):
        stored.content.delete(save=False)
        stored.delete()
