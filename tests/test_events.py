"""Structured logs: one JSON line per lifecycle event, from the API and the worker, no text."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from contract import events
from llmqueue.models import PromptRequest, Tenant
from tests.conftest import SIMULATED, Seeded, WorkerFactory, pretend_live, wait_until
from tests.test_api import post
from tests.test_cancel import ask, cancel

pytestmark = pytest.mark.django_db(transaction=True)
S = PromptRequest.Status
SECRET = "the tenant's secret prompt"


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def api_lines() -> Iterator[list[logging.LogRecord]]:
    """The event lines this process (the API under test) writes."""
    logger = logging.getLogger(events.LOGGER)  # its own handler: it does not reach the root
    kept = Kept()
    logger.addHandler(kept)
    yield kept.records
    logger.removeHandler(kept)


def lines_of(records: list[logging.LogRecord]) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in records if r.name == events.LOGGER]


def worker_lines(path: Path) -> list[dict[str, Any]]:
    found = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            found.append(json.loads(line))
    return found


def test_a_request_logs_each_step_once_without_its_text(
    live_server, seeded: Seeded, start_worker: WorkerFactory, tmp_path: Path, api_lines: list
):
    log = tmp_path / "worker.log"
    start_worker("default", *SIMULATED, "--sim-time-scale", "0", log_path=log)
    body = {"model": "sim", "prompt": SECRET, "max_tokens": 3}
    answer = post(live_server, "/v1/completions", seeded.key, body)
    assert answer.status_code == 200, answer.text
    request_id = answer.headers["X-LLMQueue-Request-Id"]
    [admitted] = lines_of(api_lines)
    assert admitted["event"] == "admitted"
    assert {k: admitted[k] for k in ("request_id", "tenant", "pool", "tier", "model")} == {
        "request_id": request_id,
        "tenant": "acme",
        "pool": "default",
        "tier": "interactive",
        "model": "sim",
    }
    wait_until(lambda: len(worker_lines(log)) >= 3, 10, "the worker's event lines")
    seen = worker_lines(log)
    assert [line["event"] for line in seen] == ["dispatched", "first_token", "finished"]
    assert {line["request_id"] for line in seen} == {request_id}
    row = PromptRequest.objects.get(pk=request_id)
    dispatched, first, finished = seen
    assert dispatched["attempt"] == 1 and dispatched["worker"].startswith("default-test-")
    assert first["ts"] == pytest.approx(row.first_token_at.timestamp(), abs=1e-5)
    assert finished["ts"] == pytest.approx(row.finished_at.timestamp(), abs=1e-5)
    assert (finished["outcome"], finished["completion_tokens"]) == ("succeeded", 3)
    # (the engine may start a request before its claim is written: no order between those two)
    assert finished["total_seconds"] >= max(first["ttft_seconds"], finished["queue_seconds"])
    assert min(first["ttft_seconds"], finished["queue_seconds"]) >= 0
    text = log.read_text() + "".join(r.getMessage() for r in api_lines)
    assert SECRET not in text and row.output_text not in text


def test_rejections_and_cancellations_are_logged_by_the_api(
    live_server, seeded: Seeded, clean_redis: redis.Redis, api_lines: list
):
    pretend_live(clean_redis, "default")
    Tenant.objects.filter(pk=seeded.tenant_id).update(tokens_per_minute=600)
    request_id = ask(live_server, seeded.key).json()["id"]
    assert ask(live_server, seeded.key).status_code == 429
    assert cancel(live_server, seeded.key, request_id).status_code == 200
    admitted, rejected, cancelled = lines_of(api_lines)
    assert (admitted["event"], rejected["event"], cancelled["event"]) == (
        "admitted",
        "rejected",
        "cancelled",
    )
    assert (rejected["reason"], rejected["status"], rejected["tenant"]) == ("tokens", 429, "acme")
    assert rejected["retry_after_seconds"] > 0
    assert (cancelled["request_id"], cancelled["outcome"]) == (request_id, "cancelled")
    assert "ttft_seconds" not in cancelled and "queue_seconds" not in cancelled
