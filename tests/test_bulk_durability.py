"""A batch survives its API and pacer killed, a worker SIGKILLed, and Redis restarted with or
without its data: every line ends in exactly one output line, none twice (issue 12, part 7)."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

import httpx
import pytest
import redis

from contract.keys import RECONCILED_KEY
from llmqueue.models import BulkJob, PromptRequest
from tests.conftest import SIMULATED, Seeded, wait_until
from tests.reliability_record import record
from tests.stack import Stack, kill, stack_fixture  # noqa: F401 (the stack fixture)
from tests.test_batches import jsonl, line
from tests.test_crash_recovery import listen

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
LINES = 48
# ~32 decode steps of ~37 ms: a line takes ~1.2 s and 16 run at once, so the job lasts a few
# seconds and is surely mid-way when the fault comes.
WORKER = (*SIMULATED, "--sim-time-scale", "5")
MAX_TOKENS = 32


def headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def start_batch(stack: Stack, key: str) -> str:
    """Upload LINES lines and create their batch through the running API; returns its id."""
    lines = [line(f"line-{i}", prompt=f"prompt {i}", max_tokens=MAX_TOKENS) for i in range(LINES)]
    uploaded = httpx.post(
        f"{stack.api_url}/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", jsonl(lines), "application/jsonl")},
        headers=headers(key),
        timeout=30,
    )
    assert uploaded.status_code == 200, uploaded.text
    body = {
        "input_file_id": uploaded.json()["id"],
        "endpoint": "/v1/completions",
        "completion_window": "24h",
    }
    created = httpx.post(f"{stack.api_url}/v1/batches", json=body, headers=headers(key), timeout=30)
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def succeeded() -> int:
    return PromptRequest.objects.filter(status=S.SUCCEEDED).count()


def finished_batch(stack: Stack, key: str, batch_id: str, timeout: float) -> dict[str, Any]:
    def completed() -> bool:
        return BulkJob.objects.filter(pk=batch_id, status=BulkJob.Status.COMPLETED).exists()

    wait_until(completed, timeout, "the batch to complete")
    batch = httpx.get(f"{stack.api_url}/v1/batches/{batch_id}", headers=headers(key), timeout=10)
    assert batch.status_code == 200, batch.text
    return dict(batch.json())


def output_lines(stack: Stack, key: str, file_id: str) -> list[dict[str, Any]]:
    url = f"{stack.api_url}/v1/files/{file_id}/content"
    content = httpx.get(url, headers=headers(key), timeout=30)
    assert content.status_code == 200, content.text
    return [json.loads(x) for x in content.text.splitlines()]


def assert_each_line_once(stack: Stack, key: str, batch: dict[str, Any]) -> None:
    assert batch["status"] == "completed" and batch["error_file_id"] is None
    assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    out = output_lines(stack, key, batch["output_file_id"])
    assert [o["custom_id"] for o in out] == [f"line-{i}" for i in range(LINES)]
    assert {o["response"]["status_code"] for o in out} == {200}
    usage = [o["response"]["body"]["usage"]["completion_tokens"] for o in out]
    assert usage == [MAX_TOKENS] * LINES
    assert PromptRequest.objects.filter(status=S.SUCCEEDED).count() == LINES


def test_a_batch_survives_its_api_and_pacer_killed_mid_job(seeded: Seeded, stack: Stack):
    stack.start_redis()
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    api = stack.start_api(seeded.other_key)
    pacer = stack.start_pacer()
    stack.start_worker(client, *WORKER)
    batch_id = start_batch(stack, seeded.other_key)
    wait_until(lambda: succeeded() >= 5, 60, "the first lines to finish")
    assert kill(api, signal.SIGKILL) == -signal.SIGKILL
    assert kill(pacer, signal.SIGKILL) == -signal.SIGKILL
    assert succeeded() < LINES  # the job is mid-way
    stack.start_api(seeded.other_key)
    stack.start_pacer()
    batch = finished_batch(stack, seeded.other_key, batch_id, 90)
    assert_each_line_once(stack, seeded.other_key, batch)
    assert set(PromptRequest.objects.values_list("attempts", flat=True)) == {1}


def test_a_batch_survives_a_worker_sigkilled_mid_job(seeded: Seeded, stack: Stack):
    stack.start_redis()
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    stack.start_api(seeded.other_key)
    stack.start_pacer()
    published, stop, listener = listen(client)
    doomed, _ = stack.start_worker(client, *WORKER)
    batch_id = start_batch(stack, seeded.other_key)
    wait_until(lambda: PromptRequest.objects.filter(status=S.RUNNING).count() >= 8, 60, "running")
    assert kill(doomed, signal.SIGKILL) == -signal.SIGKILL
    killed = set(PromptRequest.objects.filter(status=S.RUNNING).values_list("id", flat=True))
    stack.start_worker(client, *WORKER)
    batch = finished_batch(stack, seeded.other_key, batch_id, 120)
    stop.set()
    listener.join(timeout=5)
    assert_each_line_once(stack, seeded.other_key, batch)
    # The killed worker's lines ran again on the survivor (their second attempt); each result
    # was published once.
    rows = PromptRequest.objects.all()
    assert {r.id for r in rows if r.attempts == 2} == killed
    assert [k for k, n in published.items() if n != 1] == []


@pytest.mark.parametrize("aof", [True, False], ids=["with-its-data", "without-its-data"])
def test_a_batch_survives_a_redis_restart_mid_job(seeded: Seeded, stack: Stack, aof: bool):
    durable = ("--appendfsync", "always") if aof else ("--appendonly", "no")
    first = stack.start_redis(*durable)
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=5)
    stack.start_api(seeded.other_key)
    stack.start_pacer()
    stack.start_worker(client, *WORKER)
    batch_id = start_batch(stack, seeded.other_key)
    wait_until(lambda: succeeded() >= 5, 60, "the first lines to finish")
    # The server ends cleanly (no reply lost in flight): with the AOF fsynced at every write it
    # comes back with everything; without it, with nothing.
    assert kill(first, signal.SIGTERM) == 0
    stack.start_redis(*durable)
    restarted_at = time.time()
    assert succeeded() < LINES  # the job is mid-way
    if not aof:  # recovered once the reconciler has put the lost messages back
        wait_until(lambda: int(client.get(RECONCILED_KEY) or 0) > 0, 60, "a republish")
        recovery_s = time.time() - restarted_at
    batch = finished_batch(stack, seeded.other_key, batch_id, 120)
    assert_each_line_once(stack, seeded.other_key, batch)
    republished = int(client.get(RECONCILED_KEY) or 0)
    if aof:
        assert republished == 0  # every message came back with the data: none published anew
    else:
        # The lines then queued lost their messages and were published anew; the running ones
        # finished where they were.
        assert 0 < republished < LINES
        rows = PromptRequest.objects.all()
        record(
            "redis_data_loss",
            accepted=LINES,
            completed=sum(r.status == PromptRequest.Status.SUCCEEDED for r in rows),
            lost=sum(r.status != PromptRequest.Status.SUCCEEDED for r in rows),
            duplicated=0,  # assert_each_line_once: every line's output exactly once
            recovery_s=round(recovery_s, 2),
            republished=republished,
        )
