"""Flower, started by `manage.py flower`, shows every (pool, tier) queue's backlog."""

from __future__ import annotations

import sys

import httpx
import pytest

from llmqueue.api.auth import caller_for_key
from llmqueue.api.validation import PromptSpec
from llmqueue.queueing.routing import all_queues, resolve_model
from llmqueue.queueing.submission import submit_prompts
from tests.conftest import REPO, SIMULATED, Seeded, WorkerFactory, subprocess_env, wait_until
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


def submit(key: str, model: str, n: int) -> None:
    caller, route = caller_for_key(key), resolve_model(model)
    spec = PromptSpec("completion", model, "hi", None, {"max_tokens": 2}, 1, background=True)
    submit_prompts(caller, route, [spec] * n, chunk_size=1)


def start_flower(env: dict[str, str]) -> tuple[processes.Child, str]:
    port = free_port()
    argv = [sys.executable, "manage.py", "flower", f"--port={port}", "--address=127.0.0.1"]
    child = processes.start("flower", argv, cwd=REPO, env=env, ports=(port,), inherit_output=True)
    return child, f"http://127.0.0.1:{port}"


def test_flower_shows_every_tier_of_two_pools_and_each_gpu_worker_behind_its_login(
    seeded: Seeded, start_worker: WorkerFactory
):
    # Backlogs nobody consumes: the workers serve only their pools' batch queues.
    submit(seeded.key, "sim", 3)  # default.interactive
    submit(seeded.key, "tiny-llama", 2)  # tiny.interactive
    nodes = {"default": "default-gpu0@host-a", "tiny": "tiny-gpu1@host-b"}
    for pool, node in nodes.items():
        start_worker(
            pool, *SIMULATED, "--sim-time-scale", "0", "--queues", f"{pool}.batch", node=node
        )
    env = dict(subprocess_env(), FLOWER_BASIC_AUTH="ops:s3cret")
    flower, url = start_flower(env)
    login = ("ops", "s3cret")
    try:
        lengths: dict[str, int] = {}
        workers: dict[str, object] = {}

        def reported() -> bool:
            assert flower.running(), "flower exited"
            try:
                queues = httpx.get(f"{url}/api/queues/length", auth=login, timeout=5).json()
                found = httpx.get(f"{url}/api/workers?refresh=1", auth=login, timeout=10).json()
            except (httpx.HTTPError, ValueError):
                return False
            lengths.update({q["name"]: q["messages"] for q in queues["active_queues"]})
            workers.update(found)
            return set(nodes.values()) <= set(workers)

        wait_until(reported, 60, "flower's queues and workers")
        refused = httpx.get(f"{url}/api/queues/length", timeout=5)
        workers_page = httpx.get(f"{url}/workers", auth=login, timeout=10)
    finally:
        processes.stop(flower, grace_seconds=30)
    assert lengths == {
        "celery": 0,
        "default.batch": 0,
        "default.interactive": 3,
        "tiny.batch": 0,
        "tiny.interactive": 2,
    }
    assert set(workers) == set(nodes.values())
    assert refused.status_code == 401  # the API is behind the login
    assert workers_page.status_code == 200  # the workers view, filled from /api/workers


def test_flower_keeps_its_api_closed_without_a_login(seeded: Seeded):
    flower, url = start_flower(subprocess_env())
    try:
        answer: list[httpx.Response] = []

        def answered() -> bool:
            assert flower.running(), "flower exited"
            try:
                answer.append(httpx.get(f"{url}/api/queues/length", timeout=5))
            except httpx.HTTPError:
                return False
            return True

        wait_until(answered, 60, "flower")
    finally:
        processes.stop(flower, grace_seconds=30)
    assert answer[-1].status_code == 401
