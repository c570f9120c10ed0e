"""Retrying a finished job's failed and expired lines (the admin's action) as fresh held lines.

They are released by the pacer and run again; cancelled lines and jobs, and running jobs, are
left alone."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import redis
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.test import Client
from django.utils import timezone

from contract.keys import waiting_key
from llmqueue.bulk.cancel import cancel_job
from llmqueue.bulk.finalize import advance_jobs
from llmqueue.bulk.jobs import line_counts
from llmqueue.bulk.pacer import Pacer
from llmqueue.bulk.retry import retry_failed
from llmqueue.models import BulkJob, PromptRequest, StoredFile, Tier
from tests.conftest import (
    SIMULATED,
    Seeded,
    WorkerFactory,
    pacer_running,
    queued_messages,
    wait_until,
)
from tests.test_batches import line
from tests.test_bulk_views import job_of

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
J = BulkJob.Status
CHANGELIST = "/admin/llmqueue/bulkjob/"


def fail_as_the_engine_did(row: PromptRequest) -> None:
    """The row as a worker's recorder leaves it after an engine failure on its first claim."""
    now = timezone.now()
    PromptRequest.objects.filter(pk=row.pk).update(
        status=S.FAILED, attempts=1, worker="default-gpu0@host", started_at=now,
        finished_at=now, error="engine failure: RuntimeError: boom",
    )  # fmt: skip


def file_lines(stored: StoredFile | None) -> list[dict]:
    assert stored is not None
    with stored.content.open("rb") as handle:
        return [json.loads(x) for x in handle.read().splitlines()]


def test_retry_failed_turns_failed_and_expired_lines_into_succeeded_ones(
    seeded: Seeded,
    bulk_tier: Tier,
    clean_redis: redis.Redis,
    start_worker: WorkerFactory,
    admin_client: Client,
):
    job = job_of(seeded.tenant_id, [line(f"r{i}", max_tokens=3) for i in range(6)])
    rows = list(PromptRequest.objects.filter(job=job).order_by("line"))
    fail_as_the_engine_did(rows[1])
    fail_as_the_engine_did(rows[4])
    advance_jobs(job.expires_at + timedelta(seconds=1))  # the window ended, 4 lines never ran
    job.refresh_from_db()
    assert (job.status, job.output_file) == (J.EXPIRED, None)
    codes = [e["error"]["code"] for e in file_lines(job.error_file)]
    assert codes == ["batch_expired", "request_failed", "batch_expired"] * 2
    old_file = job.error_file_id

    retry = {"action": "retry_failed_lines", ACTION_CHECKBOX_NAME: [job.pk]}
    answer = admin_client.post(CHANGELIST, retry, follow=True)
    assert "Retrying 6 line(s) of 1 job(s)." in answer.content.decode()
    job.refresh_from_db()
    assert (job.status, job.output_file_id, job.error_file_id) == (J.IN_PROGRESS, None, None)
    assert job.expires_at > timezone.now() + timedelta(hours=23)
    assert not StoredFile.objects.filter(pk=old_file).exists()
    fresh = PromptRequest.objects.filter(job=job).order_by("line")
    assert set(fresh.values_list("status", "attempts", "error", "finished_at", "deadline_at")) == {
        (S.HELD, 0, "", None, job.expires_at)
    }
    assert [(r.custom_id, r.line, r.prompt) for r in fresh] == [
        (r.custom_id, r.line, r.prompt) for r in rows
    ]
    # New request ids (task ids Celery has not seen); the old rows are gone.
    assert not {r.id for r in fresh} & {r.id for r in rows}
    assert PromptRequest.objects.count() == 6

    start_worker("default", *SIMULATED)
    with pacer_running():
        wait_until(lambda: BulkJob.objects.get(pk=job.pk).status == J.COMPLETED, 60, "the retry")
    job.refresh_from_db()
    assert line_counts(job) == {S.SUCCEEDED: 6} and job.total == 6
    assert job.error_file is None
    out = file_lines(job.output_file)
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(6)]
    assert [o["response"]["body"]["usage"]["completion_tokens"] for o in out] == [3] * 6
    assert [o["response"]["request_id"] for o in out] == [str(r.id) for r in fresh]
    wait_until(lambda: queued_messages(clean_redis) == 0, 10, "every message to be acked")
    # Each retried line was counted waiting once and taken out once by its first claim.
    assert int(clean_redis.get(waiting_key("default.batch", seeded.tenant_id)) or 0) == 0
    assert set(PromptRequest.objects.values_list("attempts", flat=True)) == {1}


def test_retry_leaves_cancelled_lines_cancelled_jobs_and_running_jobs_alone(
    seeded: Seeded, admin_client: Client, clean_redis: redis.Redis
):
    job = job_of(seeded.tenant_id, [line(f"r{i}") for i in range(3)])
    assert retry_failed(job) == 0  # in progress: nothing to retry yet
    rows = list(PromptRequest.objects.filter(job=job).order_by("line"))
    fail_as_the_engine_did(rows[0])
    PromptRequest.objects.filter(pk=rows[1].pk).update(status=S.CANCELLED)
    PromptRequest.objects.filter(pk=rows[2].pk).update(status=S.SUCCEEDED, output_text="kept")
    advance_jobs()
    job.refresh_from_db()
    assert job.status == J.COMPLETED
    assert retry_failed(job) == 1
    statuses = dict(PromptRequest.objects.filter(job=job).values_list("custom_id", "status"))
    assert statuses == {"r0": S.HELD, "r1": S.CANCELLED, "r2": S.SUCCEEDED}
    assert BulkJob.objects.get(pk=job.pk).status == J.IN_PROGRESS
    assert Pacer().release_once() == 1 and queued_messages(clean_redis) == 1

    cancelled = job_of(seeded.tenant_id, [line("c0"), line("c1")])
    cancel_job(cancelled)
    advance_jobs()
    assert BulkJob.objects.get(pk=cancelled.pk).status == J.CANCELLED
    retry = {"action": "retry_failed_lines", ACTION_CHECKBOX_NAME: [cancelled.pk]}
    answer = admin_client.post(CHANGELIST, retry, follow=True).content.decode()
    assert "Retrying 0 line(s) of 0 job(s); 1 left as they are" in answer
    assert BulkJob.objects.get(pk=cancelled.pk).status == J.CANCELLED
    assert set(PromptRequest.objects.filter(job=cancelled).values_list("status", flat=True)) == {
        S.CANCELLED
    }
