"""Bulk jobs: create one from a validated input file (its lines stored held), count its lines.

A job's lines are PromptRequest rows stored `held` in chunked transactions; the pacer
(llmqueue/bulk/pacer.py) releases them into the broker as quotas and queue depth allow, so a job
is never refused for being big. The job row is written on its own transitions only: counts are
read from the lines, grouped by status.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError, transaction
from django.db.models import Count
from django.utils import timezone

from llmqueue.admission.request import tokens_needed
from llmqueue.api.auth import Caller
from llmqueue.api.errors import BadRequest, InvalidParameter
from llmqueue.bulk.files import own_file, read_content
from llmqueue.bulk.lines import ENDPOINTS, Line, LineError, parse_lines
from llmqueue.models import BulkJob, PromptRequest, StoredFile
from llmqueue.queueing.routing import ModelRoute
from llmqueue.queueing.submission import new_request

log = logging.getLogger(__name__)
S = PromptRequest.Status
J = BulkJob.Status
UNFINISHED = (S.HELD, S.QUEUED, S.RUNNING)
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
EXPIRED_LINE_ERROR = "its batch's completion window ended before it ran"


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's metadata: at most 16 string pairs, keys ≤ 64 and values ≤ 512 characters."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise BadRequest("'metadata' must be an object of strings.", param="metadata")
    if len(metadata) > METADATA_PAIRS or any(
        len(k) > METADATA_KEY_CHARS or len(v) > METADATA_VALUE_CHARS for k, v in metadata.items()
    ):
        raise InvalidParameter(
            f"'metadata' takes at most {METADATA_PAIRS} pairs, keys of at most "
            f"{METADATA_KEY_CHARS} and values of at most {METADATA_VALUE_CHARS} characters.",
            param="metadata",
        )
    return metadata


def completion_window_seconds(window: Any) -> int:
    windows: dict[str, int] = settings.LLMQUEUE_BULK_COMPLETION_WINDOWS
    if not isinstance(window, str) or window not in windows:
        raise InvalidParameter(
            f"'completion_window' must be one of {', '.join(windows)}; got {window!r}.",
            param="completion_window",
        )
    return windows[window]


def check_endpoint(endpoint: Any) -> str:
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise InvalidParameter(
            f"'endpoint' must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}.",
            code="invalid_endpoint",
            param="endpoint",
        )
    return str(endpoint)


def input_file(caller: Caller, file_id: Any) -> StoredFile:
    if not isinstance(file_id, str) or not file_id:
        raise BadRequest(
            "'input_file_id' is required.", code="missing_parameter", param="input_file_id"
        )
    stored = own_file(caller.tenant_id, file_id)
    if stored.purpose != StoredFile.Purpose.BATCH:
        raise InvalidParameter(
            f"File {file_id} has purpose {stored.purpose!r}; a batch's input needs 'batch'.",
            param="input_file_id",
        )
    return stored


def create_job(caller: Caller, body: dict[str, Any], now: datetime | None = None) -> BulkJob:
    """A batch from `body` (input_file_id, endpoint, completion_window, metadata): failed at
    validation with its errors by line and nothing stored of its lines, or in progress with
    every line stored held."""
    endpoint = check_endpoint(body.get("endpoint"))
    completion_window_seconds(body.get("completion_window"))  # refused before the file is read
    metadata = check_metadata(body.get("metadata"))
    stored = input_file(caller, body.get("input_file_id"))
    now = now or timezone.now()
    job = new_job(caller, stored, endpoint, body["completion_window"], metadata, now)
    parsed = parse_lines(read_content(stored), caller, endpoint)
    if parsed.errors or parsed.route is None:
        return fail_validation(job, parsed.errors)
    return start_job(job, caller, parsed.route, parsed.lines, now)


def new_job(
    caller: Caller,
    stored: StoredFile,
    endpoint: str,
    window: str,
    metadata: dict[str, str] | None,
    now: datetime,
) -> BulkJob:
    """The job's row, validating, on the caller's tenant and tier; it expires `window` from now."""
    return BulkJob.objects.create(
        tenant_id=caller.tenant_id,
        tier_id=caller.tier_id,
        endpoint=endpoint,
        completion_window=window,
        input_file=stored,
        metadata=metadata,
        expires_at=now + timedelta(seconds=completion_window_seconds(window)),
    )


def start_job(
    job: BulkJob, caller: Caller, route: ModelRoute, lines: list[Line], now: datetime
) -> BulkJob:
    """Store a validated job's lines held and put it in progress (the pacer takes it on)."""
    try:
        store_lines(job, caller, route, lines, now)
    except DatabaseError:
        log.exception("could not store the lines of %s", job.id)
        PromptRequest.objects.filter(job=job).delete()
        return fail_validation(
            job, [LineError("storage_failed", "The lines could not be stored; retry.")]
        )
    BulkJob.objects.filter(pk=job.pk).update(
        status=J.IN_PROGRESS, in_progress_at=timezone.now(), total=len(lines), model=route.name,
    )  # fmt: skip
    job.refresh_from_db()
    return job


def fail_validation(job: BulkJob, errors: list[LineError]) -> BulkJob:
    job.status = J.FAILED
    job.failed_at = timezone.now()
    job.errors = [e.as_dict() for e in errors]
    job.save(update_fields=["status", "failed_at", "errors"])
    return job


def store_lines(
    job: BulkJob, caller: Caller, route: ModelRoute, lines: list[Line], now: datetime
) -> None:
    """INSERT the lines as held rows, LLMQUEUE_BULK_INSERT_CHUNK per transaction. Each holds
    its job's deadline and what it will reserve when released (prompt + max_tokens)."""
    size = settings.LLMQUEUE_BULK_INSERT_CHUNK
    for start in range(0, len(lines), size):
        rows = []
        for line in lines[start : start + size]:
            row = new_request(caller, route, line.spec, now, tokens_needed(line.spec))
            row.status = S.HELD
            row.deadline_at = job.expires_at
            row.job_id = job.pk
            row.custom_id = line.custom_id
            row.line = line.number
            rows.append(row)
        with transaction.atomic():
            PromptRequest.objects.bulk_create(rows)


def line_counts(job: BulkJob) -> dict[str, int]:
    """The job's lines by status, in one GROUP BY."""
    grouped = PromptRequest.objects.filter(job=job).order_by().values_list("status")
    return {status: n for status, n in grouped.annotate(n=Count("id"))}
