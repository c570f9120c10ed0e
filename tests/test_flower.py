"""Flower, started by `manage.py flower`, shows every (pool, tier) queue's backlog."""

from __future__ import annotations

import sys

import httpx
import pytest

from llmqueue.api.auth import caller_for_key
from llmqueue.api.validation import PromptSpec
from llmqueue.queueing.routing import all_queues, resolve_model
from llmqueue.queueing.submission import submit_prompts
from tests.conftest import REPO, Seeded, subprocess_env, wait_until
from workers import processes
from workers.processes import free_port

pytestmark = pytest.mark.django_db(transaction=True)


def test_every_pool_and_tier_queue_is_declared(seeded: Seeded):
    assert all_queues() == [
        "default.interactive",
        "default.batch",
        "tiny.interactive",
        "tiny.batch",
    ]


def test_flower_shows_a_tiers_backlog_while_no_worker_consumes_it(seeded: Seeded):
    caller, route = caller_for_key(seeded.key), resolve_model("sim")
    spec = PromptSpec("completion", "sim", "hi", None, {"max_tokens": 2}, 1, background=True)
    submit_prompts(caller, route, [spec, spec, spec], chunk_size=1)

    port = free_port()
    env = dict(subprocess_env(), FLOWER_UNAUTHENTICATED_API="true")
    argv = [sys.executable, "manage.py", "flower", f"--port={port}", "--address=127.0.0.1"]
    flower = processes.start("flower", argv, cwd=REPO, env=env, ports=(port,), inherit_output=True)
    try:
        lengths: dict[str, int] = {}

        def reported() -> bool:
            assert flower.running(), "flower exited"
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/api/queues/length", timeout=5).json()
            except httpx.HTTPError:
                return False
            lengths.update({q["name"]: q["messages"] for q in body["active_queues"]})
            return True

        wait_until(reported, 60, "flower's queue lengths")
    finally:
        processes.stop(flower, grace_seconds=30)
    assert lengths == {
        "celery": 0,
        "default.batch": 0,
        "default.interactive": 3,
        "tiny.batch": 0,
        "tiny.interactive": 0,
    }
