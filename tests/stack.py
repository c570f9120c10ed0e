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
from tests.netns import LOCAL, Host
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
    PID and process group (workers/processes.py), and waits until their ports are free.

    Everything runs on this machine's loopback unless told otherwise: a partition test puts
    Redis on a bridge address and the API and each worker in a host of its own (tests/netns.py),
    with `database_url` the children's way to the database from there."""

    tmp: Path
    redis_port: int = field(default_factory=free_port)
    api_port: int = field(default_factory=free_port)
    started: list[processes.Child] = field(default_factory=list)
    redis_host: Host = LOCAL
    api_host: Host = LOCAL
    database_url: str | None = None

    @property
    def redis_url(self) -> str:
        return f"redis://{self.redis_host.address}:{self.redis_port}/0"

    @property
    def api_url(self) -> str:
        return f"http://{self.api_host.address}:{self.api_port}"

    def env(self) -> dict[str, str]:
        env = {**subprocess_env(), "REDIS_URL": self.redis_url}
        return env if self.database_url is None else env | {"DATABASE_URL": self.database_url}

    def spawn(
        self, name: str, argv: list[str], host: Host = LOCAL, **kwargs: Any
    ) -> subprocess.Popen[bytes]:
        """Start `argv` (in `host`'s network namespace, if it has one) as a child of the stack."""
        child = processes.start(name, host.argv(argv), **kwargs)
        self.started.append(child)
        return child.popen

    def start_redis(self, *extra: str) -> subprocess.Popen[bytes]:
        """A server on this test's port and data dir; the same dir across restarts, as the
        demo's embedded server keeps it. `--save ""`: only the AOF carries data over."""
        data_dir = self.tmp / "redis"
        data_dir.mkdir(exist_ok=True)
        argv = [*server_argv(server_binary(), self.redis_port, data_dir), "--save", ""]
        # The last bind wins; on the namespaces' bridge, other hosts' clients are no threat.
        argv += ["--bind", self.redis_host.address, *extra]
        if self.redis_host != LOCAL:
            argv += ["--protected-mode", "no"]
        process = self.spawn("redis", argv, self.redis_host, ports=(self.redis_port,))
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
            sys.executable, "-m", "granian", "--interface", "wsgi",
            "--host", self.api_host.address, "--port", str(self.api_port),
            "--workers", str(workers), "--blocking-threads", str(threads),
            "--no-ws", "--log-level", "warning", *extra, "project.wsgi:application",
        ]  # fmt: skip
        # Django answers 400 to a Host header it does not know: the API host's own address.
        env = self.env() | {"ALLOWED_HOSTS": self.api_host.address}
        process = self.spawn(
            "api",
            argv,
            self.api_host,
            cwd=REPO,
            env=env,
            ports=(self.api_port,),
            inherit_output=True,
        )

        def ready() -> bool:
            alive(process, "API")
            try:
                return get(self, "/v1/models", key).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(ready, 30, "the API")
        return process

    def start_worker(
        self,
        client: redis.Redis,
        *args: str,
        host: Host = LOCAL,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> tuple[subprocess.Popen[bytes], str]:
        """A worker of pool "default" on `host`, its output to `log_path` if given, with the
        settings `env` of its own; returns once it beats."""
        node = f"default-faults-{uuid.uuid4().hex[:6]}@localhost"
        argv = worker_argv(slots=SlotOptions(pool="default"), node=node, extra=args)
        process = self.spawn(
            node,
            argv,
            host,
            cwd=REPO,
            env=self.env() | (env or {}),
            log_path=log_path,
            inherit_output=log_path is None,
        )

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
