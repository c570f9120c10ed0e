"""`manage.py bulk_submit` and `manage.py bulk_results` as an operator runs them (real processes,
no terminal, as under CI): exit statuses, the progress bar on stderr, results in input order."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import redis

from llmqueue.bulk.cancel import cancel_job
from llmqueue.bulk.finalize import advance_jobs, render
from llmqueue.models import BulkJob, PromptRequest, Tier
from tests.conftest import (
    REPO,
    SIMULATED,
    Seeded,
    WorkerFactory,
    queued_messages,
    subprocess_env,
    wait_until,
)
from tests.test_batches import jsonl, line
from tests.test_bulk_views import assert_nothing_stored, finish

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status


def manage(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, env=subprocess_env(),
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def start_manage(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "manage.py", *args], cwd=REPO, env=subprocess_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_bytes().splitlines()]


def test_bulk_submit_refuses_a_bad_file_with_status_2_and_stores_nothing(
    seeded: Seeded, clean_redis: redis.Redis, tmp_path: Path
):
    bad = tmp_path / "in.jsonl"
    bad.write_bytes(jsonl([line("a"), b"{oops", line("c", max_tokens=100_000)]))
    done = manage("bulk_submit", str(bad), "--tenant", "acme")
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines[0] == (
        "line 2: invalid_json: The line is not valid JSON: Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1)."
    )
    assert lines[1].startswith("line 3: invalid_parameter (max_tokens): ")
    assert "CommandError: in.jsonl: nothing submitted, 2 bad line(s)." in done.stderr
    unknown = manage("bulk_submit", str(bad), "--tenant", "nope")
    assert unknown.returncode == 2 and "No tenant named 'nope'." in unknown.stderr
    assert_nothing_stored(clean_redis)


def test_bulk_submit_waits_for_completion_and_bulk_results_writes_input_order(
    seeded: Seeded,
    bulk_tier: Tier,
    clean_redis: redis.Redis,
    start_worker: WorkerFactory,
    pacer_thread: None,
    tmp_path: Path,
):
    start_worker("default", *SIMULATED)
    prompts = tmp_path / "prompts.csv"
    rows = "".join(f"p{i},tell me about {i},{1 + i % 4}\n" for i in range(10))
    prompts.write_text(f"custom_id,prompt,max_tokens\n{rows}")
    done = manage(
        "bulk_submit", str(prompts), "--tenant", "acme", "--model", "sim", "--poll-seconds", "0.2"
    )
    assert done.returncode == 0, done.stderr
    job = BulkJob.objects.get()
    assert done.stdout == f"{job.id}\n" and job.status == BulkJob.Status.COMPLETED
    bars = done.stderr.splitlines()
    assert "\r" not in done.stderr and len(bars) >= 2  # a line per change, no terminal
    assert bars[0].startswith("[") and "/10 done" in bars[0]
    assert bars[-1] == f"[{'#' * 30}] 100%  10/10 done: succeeded 10  completed"

    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    written = manage("bulk_results", job.id, "-o", str(out), "--errors", str(err))
    assert written.returncode == 0, written.stderr
    assert written.stderr == f"10 line(s) to {out}; 0 to {err} (job completed).\n"
    results = read_jsonl(out)
    assert [r["custom_id"] for r in results] == [f"p{i}" for i in range(10)]
    assert [r["response"]["body"]["usage"]["completion_tokens"] for r in results] == [
        1 + i % 4 for i in range(10)
    ]
    assert err.read_bytes() == b""
    assert out.read_bytes() == render(job)[0]  # the job's own output file, byte for byte
    wait_until(lambda: queued_messages(clean_redis) == 0, 10, "every message to be acked")


@pytest.mark.parametrize("ending", ["cancelled", "expired"])
def test_bulk_submit_exits_1_when_the_job_ends_without_completing(
    seeded: Seeded, clean_redis: redis.Redis, tmp_path: Path, ending: str
):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([line(f"r{i}") for i in range(3)]))
    # No pacer runs: the lines stay held until the test ends the job.
    child = start_manage("bulk_submit", str(path), "--tenant", "acme", "--poll-seconds", "0.2")
    try:
        in_progress = BulkJob.objects.filter(status=BulkJob.Status.IN_PROGRESS)
        wait_until(in_progress.exists, 60, "the job's lines to be stored")
        job = BulkJob.objects.get()
        if ending == "cancelled":
            cancel_job(job)
            advance_jobs()
        else:
            advance_jobs(job.expires_at + timedelta(seconds=1))
        stdout, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 1, stderr
    assert stdout == f"{job.id}\n"
    assert f"CommandError: Job {job.id} ended {ending}." in stderr
    assert "0/3 done: held 3  in_progress" in stderr.splitlines()[0]


def test_bulk_submit_no_wait_then_results_split_into_output_and_errors(
    seeded: Seeded, clean_redis: redis.Redis, tmp_path: Path
):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([line(f"r{i}") for i in range(4)]))
    done = manage("bulk_submit", str(path), "--tenant", "acme", "--no-wait")
    assert done.returncode == 0 and done.stderr == ""
    job = BulkJob.objects.get()
    assert done.stdout == f"{job.id}\n" and job.status == BulkJob.Status.IN_PROGRESS
    assert PromptRequest.objects.filter(job=job, status=S.HELD).count() == 4
    assert queued_messages(clean_redis) == 0
    rows = list(PromptRequest.objects.filter(job=job).order_by("line"))
    for row in reversed(rows[:3]):
        finish(row, succeeded=row.custom_id != "r1")
    running = tmp_path / "so-far.jsonl"
    so_far = manage("bulk_results", job.id, "-o", str(running))
    assert so_far.returncode == 0
    assert [r["custom_id"] for r in read_jsonl(running)] == ["r0", "r1", "r2"]
    assert f"Job {job.id} is in_progress: lines not finished yet are left out." in so_far.stderr
    finish(rows[3], succeeded=True)
    advance_jobs()
    job.refresh_from_db()
    out, err, every = tmp_path / "out.jsonl", tmp_path / "err.jsonl", tmp_path / "all.jsonl"
    assert manage("bulk_results", job.id, "-o", str(out), "--errors", str(err)).returncode == 0
    assert manage("bulk_results", job.id, "-o", str(every)).returncode == 0
    output, errors = render(job)
    assert (out.read_bytes(), err.read_bytes()) == (output, errors)
    assert [r["custom_id"] for r in read_jsonl(out)] == ["r0", "r2", "r3"]
    assert [(r["custom_id"], r["error"]["code"]) for r in read_jsonl(err)] == [
        ("r1", "request_failed")
    ]
    assert [r["custom_id"] for r in read_jsonl(every)] == ["r0", "r1", "r2", "r3"]
    missing = manage("bulk_results", "batch_nope", "-o", str(out))
    assert missing.returncode == 1 and "No bulk job 'batch_nope'." in missing.stderr
