"""A job's end: lines past its completion window expired, then its output and error files
rendered in input order, and its final status (completed, expired or cancelled)."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import redis
from django.utils import timezone

from llmqueue import accounting, lifecycle, lua
from llmqueue.api.responses import completion_body
from llmqueue.bulk.files import store_output
from llmqueue.bulk.jobs import EXPIRED_LINE_ERROR, UNFINISHED, line_counts
from llmqueue.models import BulkJob, PromptRequest
from llmqueue.redis_client import get_redis

log = logging.getLogger(__name__)
S = PromptRequest.Status
J = BulkJob.Status
ACTIVE = (J.IN_PROGRESS, J.CANCELLING)
ERROR_CODES = {
    S.EXPIRED: ("batch_expired", "This request could not be executed before the completion "
                "window expired."),
    S.CANCELLED: ("batch_cancelled", "This request was cancelled before it completed."),
}  # fmt: skip
_RENDER_CHUNK = 2_000


def advance_jobs(now: datetime | None = None) -> None:
    """Move every active job on: expire what its window left over, finish what is done."""
    now = now or timezone.now()
    for job in BulkJob.objects.filter(status__in=ACTIVE):
        advance_job(job, now)


def advance_job(job: BulkJob, now: datetime) -> None:
    if job.status == J.IN_PROGRESS and now >= job.expires_at:
        expire_lines(job, now)
    counts = line_counts(job)
    if any(counts.get(status, 0) for status in UNFINISHED):
        return
    if job.status == J.CANCELLING:
        final, stamp = J.CANCELLED, "cancelled_at"
    elif now >= job.expires_at and counts.get(S.EXPIRED, 0):
        final, stamp = J.EXPIRED, "expired_at"
    else:
        final, stamp = J.COMPLETED, "completed_at"
    finish_job(job, final, stamp, now)


def expire_lines(job: BulkJob, now: datetime) -> None:
    """Lines not started by the job's expiry end expired; held ones reserved nothing, queued
    ones give their reservation back (running ones finish: they reached an engine in time)."""
    PromptRequest.objects.filter(job=job, status=S.HELD).update(
        status=S.EXPIRED, finished_at=now, error=EXPIRED_LINE_ERROR
    )
    queued: list[uuid.UUID] = list(
        PromptRequest.objects.filter(job=job, status=S.QUEUED).values_list("id", flat=True)
    )
    for start in range(0, len(queued), 500):
        ended = lifecycle.expire(queued[start : start + 500], now)
        try:
            pipe = get_redis().pipeline(transaction=False)
            accounting.settle(pipe, list(ended.values()))
            lua.execute(pipe)
        except redis.RedisError:
            log.warning("could not settle the books of %d expired lines", len(ended))


def finish_job(job: BulkJob, final: str, stamp: str, now: datetime) -> None:
    """Render the files once (the conditional UPDATE picks one finalizer), then the status."""
    if job.status == J.IN_PROGRESS:
        if not BulkJob.objects.filter(pk=job.pk, status=J.IN_PROGRESS).update(
            status=J.FINALIZING, finalizing_at=now
        ):
            return
        source = J.FINALIZING
    else:
        source = job.status
    output, errors = render(job)
    BulkJob.objects.filter(pk=job.pk, status=source).update(
        status=final,
        **{stamp: timezone.now()},
        output_file=store_output(job.tenant_id, f"{job.id}_output.jsonl", output)
        if output
        else None,
        error_file=store_output(job.tenant_id, f"{job.id}_error.jsonl", errors) if errors else None,
    )


def render(job: BulkJob) -> tuple[bytes, bytes]:
    """The job's output lines (succeeded) and error lines (the rest), each in input order."""
    output: list[str] = []
    errors: list[str] = []
    for succeeded, text in rendered_lines(job):
        (output if succeeded else errors).append(text)
    return _jsonl(output), _jsonl(errors)


def rendered_lines(job: BulkJob, finished_only: bool = False) -> Iterator[tuple[bool, str]]:
    """(succeeded, its output or error line as JSON) for each line, in input order;
    `finished_only` leaves out the lines still held, queued or running (a running job's
    results so far)."""
    rows = PromptRequest.objects.filter(job=job).order_by("line")
    if finished_only:
        rows = rows.exclude(status__in=UNFINISHED)
    for row in rows.iterator(chunk_size=_RENDER_CHUNK):
        yield row.status == S.SUCCEEDED, json.dumps(output_line(row))


def _jsonl(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode() if lines else b""


def output_line(row: PromptRequest) -> dict[str, Any]:
    """OpenAI's output line: `{id, custom_id, response: {status_code, request_id, body}, error}`."""
    line: dict[str, Any] = {"id": f"batch_req_{row.id.hex}", "custom_id": row.custom_id}
    if row.status == S.SUCCEEDED:
        result = {
            "text": row.output_text,
            "prompt_tokens": row.prompt_tokens,
            "completion_tokens": row.completion_tokens,
            "finish_reason": row.finish_reason,
        }
        body = completion_body(row, result)
        line.update(response={"status_code": 200, "request_id": str(row.id), "body": body},
                    error=None)  # fmt: skip
        return line
    code, message = ERROR_CODES.get(S(row.status), ("request_failed", row.error or "failed"))
    line.update(response=None, error={"code": code, "message": message})
    return line
