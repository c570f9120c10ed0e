"""Dispatch in a real worker on real Redis: weights, headroom, deadlines, first tokens."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from celery import states
from django.utils import timezone

from llmqueue import usage
from llmqueue.api.auth import caller_for_key
from llmqueue.api.validation import PromptSpec
from llmqueue.models import PromptRequest, TenantUsage
from llmqueue.queueing.routing import resolve_model
from llmqueue.queueing.submission import submit_prompt
from project.celery import app
from tests.conftest import SIMULATED, Seeded, WorkerFactory, queued_messages, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status


def submit(key: str, n: int, max_tokens: int, prompt: str = "p") -> list[uuid.UUID]:
    caller, route = caller_for_key(key), resolve_model("sim")
    params = {"max_tokens": max_tokens, "stop": []}
    spec = PromptSpec("completion", "sim", prompt, None, params, 1, True)
    return [submit_prompt(caller, route, spec).id for _ in range(n)]


def tier_names_in_claim_order() -> str:
    rows = PromptRequest.objects.order_by("started_at").select_related("tier")
    return "".join(row.tier.name[0] for row in rows)


def test_batch_progresses_in_the_weight_ratio_under_an_interactive_backlog(
    seeded: Seeded, start_worker: WorkerFactory
):
    # Both backlogs wait before the worker starts; one slot takes them one at a time, so the
    # claim order is exactly the dispatch order: interactive 8 : batch 1, interleaved.
    submit(seeded.key, 18, max_tokens=2)
    submit(seeded.other_key, 18, max_tokens=2)
    start_worker("default", *SIMULATED, "--slots", "1", "--sim-time-scale", "0")
    wait_until(lambda: PromptRequest.objects.filter(status=S.SUCCEEDED).count() == 36, 60, "all")
    assert tier_names_in_claim_order() == "iiiibiiii" * 2 + "ii" + "b" * 16


def test_strict_dispatch_serves_batch_only_after_interactive(
    seeded: Seeded, start_worker: WorkerFactory
):
    submit(seeded.other_key, 4, max_tokens=2)
    submit(seeded.key, 6, max_tokens=2)
    start_worker(
        "default", *SIMULATED, "--slots", "1", "--sim-time-scale", "0", "--dispatch", "strict"
    )
    wait_until(lambda: PromptRequest.objects.filter(status=S.SUCCEEDED).count() == 10, 60, "all")
    assert tier_names_in_claim_order() == "i" * 6 + "b" * 4


def most_generating_at_once(rows: list[PromptRequest], step_log: Path) -> int:
    """The most of `rows` in the engine's same step (a request parked in the worker, claimed but
    not in the engine yet, generates nothing). Counted in engine steps from the worker's step log,
    not from `finished_at`: that is stamped when the recorder writes the row, which may be after
    the engine's next step has already given a newcomer its first token."""
    step_of = {}
    for line in step_log.read_text().splitlines():
        number, _, ended, *_ = line.split()
        step_of[round(float(ended) * 1e6)] = int(number)
    per_step: Counter[int] = Counter()
    for row in rows:
        assert row.first_token_at is not None and row.completion_tokens is not None
        micros = round(row.first_token_at.timestamp() * 1e6)
        [first] = [step_of[at] for at in (micros - 1, micros, micros + 1) if at in step_of]
        per_step.update(range(first, first + row.completion_tokens))  # one token per step
    return max(per_step.values())


def test_a_batch_backlog_never_holds_more_than_its_share_and_interactive_gets_in(
    seeded: Seeded, start_worker: WorkerFactory, tmp_path: Path
):
    # 4 engine sequences, 8 task slots: with no interactive traffic yet, batch (share 0.75) may
    # have 3 in the engine (one sequence stays free) and the rest parked; ~0.3 s per request.
    steps = tmp_path / "steps.log"
    start_worker(
        "default",
        *SIMULATED[:-1],
        "4",
        "--slots",
        "8",
        "--sim-time-scale",
        "1",
        "--step-log",
        str(steps),
    )
    batch = submit(seeded.other_key, 12, max_tokens=40)
    running: list[int] = []
    interactive: uuid.UUID | None = None
    while PromptRequest.objects.filter(id__in=batch, status=S.SUCCEEDED).count() < 12:
        running.append(PromptRequest.objects.filter(id__in=batch, status=S.RUNNING).count())
        if interactive is None and running[-1] >= 3:
            [interactive] = submit(seeded.key, 1, max_tokens=5)
        assert len(running) < 2000, "batch did not finish in time"
        time.sleep(0.01)
    # Claimed: the engine's 3 and the parked ones; a task slot stays free for interactive.
    assert max(running) == 7
    assert most_generating_at_once(list(PromptRequest.objects.filter(id__in=batch)), steps) == 3
    assert interactive is not None
    wait_until(lambda: PromptRequest.objects.get(id=interactive).status == S.SUCCEEDED, 10, "it")
    first = PromptRequest.objects.get(id=interactive)
    # It went straight into the engine's free sequence, ahead of the batch backlog.
    assert PromptRequest.objects.filter(id__in=batch, started_at__gt=first.started_at).count() > 0
    assert first.first_token_at is not None
    assert (first.first_token_at - first.enqueued_at).total_seconds() < 0.1
    for row in PromptRequest.objects.all():
        assert row.first_token_at is not None
        # The engine may start before the claim is written (workers/execution.py): enqueued first.
        assert row.enqueued_at < row.first_token_at <= row.finished_at


def test_an_expired_request_deep_in_the_queue_is_swept_on_time_and_never_generated(
    seeded: Seeded, start_worker: WorkerFactory, clean_redis: redis.Redis
):
    # One slot, each batch request ~1 s of engine steps: the backlog takes ~6 s to drain.
    start_worker("default", *SIMULATED, "--slots", "1", "--sim-time-scale", "1")
    ahead = submit(seeded.other_key, 6, max_tokens=130)
    [late] = submit(seeded.other_key, 1, max_tokens=130)
    # A deadline tighter than its tier's (its message still says the tier's 600 s).
    deadline = time.time() + 1.0
    PromptRequest.objects.filter(id=late).update(deadline_at=timezone.now() + timedelta(seconds=1))
    wait_until(
        lambda: PromptRequest.objects.get(id=late).status == S.EXPIRED,
        4,
        "the sweep to expire the overdue request",
    )
    expired_at = time.time()
    assert expired_at - deadline < 3  # sweep every second, however deep the message is
    # Its message is still waiting behind the backlog, and its caller already knows.
    assert clean_redis.llen("default.batch") >= 1
    assert app.backend.get_task_meta(str(late))["status"] == states.REVOKED
    wait_until(
        lambda: PromptRequest.objects.filter(id__in=ahead, status=S.SUCCEEDED).count() == 6,
        30,
        "the backlog",
    )
    wait_until(lambda: queued_messages(clean_redis) == 0, 10, "every message acked")
    row = PromptRequest.objects.get(id=late)
    assert (row.status, row.attempts, row.started_at, row.output_text) == (S.EXPIRED, 0, None, "")
    usage.flush(clean_redis)
    assert sum(TenantUsage.objects.values_list("expired", flat=True)) == 1


def test_a_worker_logs_its_engine_steps_when_asked(
    seeded: Seeded, start_worker: WorkerFactory, tmp_path
):
    path = tmp_path / "steps.log"
    start_worker("default", *SIMULATED, "--sim-time-scale", "0", "--step-log", str(path))
    [request] = submit(seeded.key, 1, max_tokens=4)
    wait_until(lambda: PromptRequest.objects.get(id=request).status == S.SUCCEEDED, 30, "it")
    row = PromptRequest.objects.get(id=request)
    ends = [float(line.split()[2]) for line in path.read_text().splitlines()]
    assert len(ends) == 4  # one line per step: 4 tokens, one step each
    assert row.first_token_at is not None
    assert row.first_token_at.timestamp() == pytest.approx(ends[0], abs=1e-6)
