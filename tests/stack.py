"""A stack of its own for fault tests: a Redis server, the API under granian, workers and the
bulk pacer as subprocesses, each stopped by PID and process group when the test ends."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from django.conf import settings

from contract import liveness
from devtools.embedded_redis import redis_answers, server_argv, server_binary
from tests.conftest import REPO, subprocess_env, wait_until
from workers import processes
from workers.command import worker_argv
from workers.options import SlotOptions
from workers.processes import free_port


def alive(process: subprocess.Popen[bytes], name: str) -> bool:
    if process.poll() is not None:
        raise AssertionError(f"{name} exited with status {process.returncode}")
    return True


@dataclass
class Stack:
    """This test's own Redis server, API and workers. Each child leads its own process group, so
    `stop_all` reaches exactly what the test started (granian's worker process included), by
    PID and process group (workers/processes.py), and waits until their ports are free."""

    tmp: Path
    redis_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    started: list[processes.Child] = field(default_factory=list)

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def env(self) -> dict[str, str]:
        return {**subprocess_env(), "REDIS_URL": self.redis_url}

    def spawn(self, name: str, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        child = processes.start(name, argv, **kwargs)
        self.started.append(child)
        return child.popen

    def start_redis(self, *extra: str) -> subprocess.Popen[bytes]:
        """A server on this test's port and data dir; the same dir across restarts, as the
        demo's embedded server keeps it. `--save ""`: only the AOF carries data over."""
        data_dir = self.tmp / "redis"
        data_dir.mkdir(exist_ok=True)
        argv = [*server_argv(server_binary(), self.redis_port, data_dir), "--save", "", *extra]
        process = self.spawn("redis", argv, ports=(self.redis_port,))
        wait_until(
            lambda: alive(process, "redis") and redis_answers(self.redis_url),
            15,
            f"redis on port {self.redis_port}",
        )
        return process

    def start_api(
        self, key: str, workers: int = 1, threads: int = 1, extra: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]:
        """granian on this stack's port, ready once it answers. By default one process of one
        thread: every call reuses the Redis connections the previous call kept. `extra`: more
        granian options."""
        argv = [
            sys.executable, "-m", "granian", "--interface", "wsgi", "--host", "127.0.0.1",
            "--port", str(self.api_port), "--workers", str(workers),
            "--blocking-threads", str(threads),
            "--no-ws", "--log-level", "warning", *extra, "project.wsgi:application",
        ]  # fmt: skip
        process = self.spawn(
            "api", argv, cwd=REPO, env=self.env(), ports=(self.api_port,), inherit_output=True
        )

        def ready() -> bool:
            alive(process, "API")
            try:
                return get(self, "/v1/models", key).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 30, "the API")
        return process

    def start_worker(self, client: redis.Redis, *args: str) -> tuple[subprocess.Popen[bytes], str]:
        node = f"default-faults-{uuid.uuid4().hex[:6]}@localhost"
        argv = worker_argv(slots=SlotOptions(pool="default"), node=node, extra=args)
        process = self.spawn(node, argv, cwd=REPO, env=self.env(), inherit_output=True)

        def ready() -> bool:
            alive(process, "worker")
            stale = settings.LLMQUEUE_WORKER_STALE_SECONDS
            return node in liveness.live_workers(client, "default", stale)

        wait_until(ready, 60, f"worker {node}")
        return process, node

    def start_pacer(self) -> subprocess.Popen[bytes]:
        """`manage.py bulk_pacer` (and reconciler) on this stack's Redis; a 2 s lease, so a
        successor takes over soon after a SIGKILL."""
        env = self.env() | {"LLMQUEUE_BULK_PACER_LEASE_SECONDS": "2"}
        argv = [sys.executable, "manage.py", "bulk_pacer"]
        return self.spawn("pacer", argv, cwd=REPO, env=env, inherit_output=True)

    def stop_all(self) -> None:
        for child in reversed(self.started):
            processes.stop(child, signal.SIGKILL)


@pytest.fixture(name="stack")
def stack_fixture(transactional_db: None, tmp_path: Path) -> Iterator[Stack]:
    """Import it as `stack_fixture` where a test takes a `stack`."""
    started = Stack(tmp_path)
    try:
        yield started
    finally:
        # Before transactional_db flushes the tables the children still use.
        started.stop_all()


def post(stack: Stack, key: str, background: bool = False, **body: Any) -> httpx.Response:
    body = {"model": "sim", "prompt": "hello", "max_tokens": 5, **body}
    if background:
        body["background"] = True
    headers = {"Authorization": f"Bearer {key}"}
    # A bound on the call should the broker hang instead of refusing the connection.
    return httpx.post(f"{stack.api_url}/v1/completions", json=body, headers=headers, timeout=30)


def get(stack: Stack, path: str, key: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{stack.api_url}{path}", headers=headers, timeout=10)


def kill(process: subprocess.Popen[bytes], sig: int) -> int:
    process.send_signal(sig)
    return process.wait(timeout=30)
