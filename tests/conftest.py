"""Shared fixtures: a dedicated Redis DB, seeded tenants, worker subprocesses, the tiny model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from django.conf import settings
from django.db import connection

from contract import liveness
from devtools.tiny_model import build_tiny_model
from llmqueue.api.auth import forget_cached_callers
from llmqueue.bulk.pacer import run_pacer
from llmqueue.defaults import create_tenant_with_key, ensure_default_tiers, ensure_served_model
from llmqueue.models import PromptRequest, Tenant, Tier
from llmqueue.queueing.publishing import publishing_key
from llmqueue.queueing.routing import forget_cached_routes
from workers import processes
from workers.command import worker_argv
from workers.options import SlotOptions
from workers.processes import free_port

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL_DIR = Path(settings.STATE_DIR) / "models" / "tiny-llama"


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(settings.REDIS_URL)
    # Never flush the shared server's default DB: tests own a dedicated one.
    assert client.connection_pool.connection_kwargs.get("db", 0) != 0
    client.flushdb()
    yield client
    client.flushdb()


@pytest.fixture
def clean_redis(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    redis_client.flushdb()
    forget_cached_callers()
    forget_cached_routes()
    yield redis_client
    redis_client.flushdb()


T0 = 1_800_000_000.0  # a fixed epoch second, so a test's clock is exact


@pytest.fixture
def live(clean_redis: redis.Redis) -> redis.Redis:
    """Redis with a worker of pool "default" alive until T0 + 1 h (admission's clock in tests)."""
    liveness.beat(clean_redis, "default", "w1", now=T0 + 3600)
    return clean_redis


@dataclass
class Seeded:
    key: str
    other_key: str
    tenant_id: int
    tier_id: int


@pytest.fixture
def seeded(transactional_db: None, clean_redis: redis.Redis) -> Seeded:
    tiers = ensure_default_tiers()
    ensure_served_model("sim", "default", context_length=2048, max_tokens=512)
    ensure_served_model("tiny-llama", "tiny", context_length=2048, max_tokens=512)
    tenant, key = create_tenant_with_key("acme", tiers["interactive"])
    _, other = create_tenant_with_key("globex", tiers["batch"])
    return Seeded(key, other, tenant.pk, tenant.tier_id)


@pytest.fixture
def bulk_tier(seeded: Seeded) -> Tier:
    """acme may run its batches on the flex tier ("batch")."""
    tier = Tier.objects.get(name="batch")
    Tenant.objects.get(pk=seeded.tenant_id).allowed_tiers.add(tier)
    return tier


@contextmanager
def pacer_running(interval_seconds: float = 0.1) -> Iterator[None]:
    """The bulk pacer (manage.py bulk_pacer's loop) in a thread of this process."""
    stop = threading.Event()
    thread = threading.Thread(target=run_pacer, args=(stop, interval_seconds), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


@pytest.fixture
def pacer_thread(seeded: Seeded) -> Iterator[None]:
    with pacer_running():
        yield


def queued_messages(client: redis.Redis) -> int:
    """Messages waiting in any broker queue or delivered but unacked."""
    total = client.hlen("unacked")
    for key in client.scan_iter(match="*.*"):
        if client.type(key) == b"list":
            total += client.llen(key)
    return int(total)


def assert_nothing_enqueued(client: redis.Redis) -> None:
    assert PromptRequest.objects.count() == 0
    assert queued_messages(client) == 0
    # Nothing admitted is still counted in a queue's depth as on its way (publishing.py).
    assert [k for k in client.scan_iter(match=publishing_key("*")) if client.zcard(k)] == []


def database_url() -> str:
    """The URL of the database the tests use, for worker subprocesses."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}{port}/{db['NAME']}"


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.settings",
        DATABASE_URL=database_url(),
        PYTHONPATH=str(REPO),
        VLLM_LOGGING_LEVEL="WARNING",
    )
    return env


@dataclass
class Worker:
    child: processes.Child
    pool: str
    node: str

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        """`sig` to this worker's PID, SIGKILL after `timeout`, then its process group."""
        return processes.stop(self.child, sig, grace_seconds=timeout)


def pretend_live(client: redis.Redis, pool: str) -> None:
    """A worker beat for `pool` that stays fresh for an hour: admission then sees a live worker
    (one busy elsewhere, say) while no process consumes the pool's queues."""
    liveness.beat(client, pool, f"{pool}-busy@localhost", now=time.time() + 3600)


def settle(
    client: redis.Redis,
    succeeded: int,
    timeout: float,
    stop: threading.Event,
    listener: threading.Thread,
) -> None:
    """Wait until `succeeded` rows succeeded and every message was acked, then stop the thread
    counting published results."""

    def all_done() -> bool:
        return (
            PromptRequest.objects.filter(status=PromptRequest.Status.SUCCEEDED).count() == succeeded
        )

    wait_until(all_done, timeout, f"{succeeded} requests to succeed")
    wait_until(lambda: queued_messages(client) == 0, 10, "every message to be acked")
    stop.set()
    listener.join(timeout=5)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


WorkerFactory = Callable[..., Worker]


def _start(
    pool: str,
    args: list[str],
    client: redis.Redis,
    timeout: float,
    log_path: Path | None,
    node: str | None,
    env: dict[str, str] | None = None,
) -> Worker:
    node = node or f"{pool}-test-{uuid.uuid4().hex[:6]}@localhost"
    argv = worker_argv(slots=SlotOptions(pool=pool), node=node, extra=args)
    # Output inherited unless a test reads it: pytest shows a failed test's worker log with it.
    child = processes.start(
        node,
        argv,
        env={**subprocess_env(), **(env or {})},
        cwd=REPO,
        log_path=log_path,
        inherit_output=log_path is None,
    )
    worker = Worker(child, pool, node)

    def ready() -> bool:
        if not child.running():
            raise AssertionError(f"worker exited with status {child.returncode}")
        return node in liveness.live_workers(client, pool, settings.LLMQUEUE_WORKER_STALE_SECONDS)

    try:
        wait_until(ready, timeout, f"worker {node}")
    except BaseException:
        worker.stop(signal.SIGKILL)
        raise
    return worker


@pytest.fixture
def start_worker(seeded: Seeded, clean_redis: redis.Redis) -> Iterator[WorkerFactory]:
    """Start `workers.serve` subprocesses; every one started is stopped (by PID) afterwards."""
    started: list[Worker] = []

    def factory(
        pool: str = "default",
        *args: str,
        timeout: float = 60,
        log_path: Path | None = None,
        node: str | None = None,
        env: dict[str, str] | None = None,
    ) -> Worker:
        """`env`: settings of this worker's own (e.g. the production visibility timeout)."""
        worker = _start(pool, list(args), clean_redis, timeout, log_path, node, env)
        started.append(worker)
        return worker

    yield factory
    for worker in started:
        worker.stop(signal.SIGKILL)


SIMULATED = ("--engine", "simulated", "--model", "sim", "--max-num-seqs", "16")


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build_tiny_model(TINY_MODEL_DIR)


def vllm_args(
    model: Path, max_num_seqs: int = 16, served: str = "tiny-llama", engine_process: bool = False
) -> tuple[str, ...]:
    """A CPU vLLM worker of the tiny model `model`, serving it as the ServedModel `served` (its
    engine in a process of its own if `engine_process`)."""
    return (
        "--engine", "vllm", "--model", str(model), "--served-model-name", served,
        "--in-process", "--enforce-eager",
        "--max-num-seqs", str(max_num_seqs), "--dtype", "float32",
        "--gpu-memory-utilization", "0.1", "--max-model-len", "2048",
        *(["--engine-process"] if engine_process else []),
    )  # fmt: skip


@pytest.fixture
def production_server(tmp_path: Path) -> Iterator[str]:
    """The README's production commands: collectstatic, then granian serving project.wsgi."""
    env = {**subprocess_env(), "STATIC_ROOT": str(tmp_path / "static")}
    collect = [sys.executable, "manage.py", "collectstatic", "--noinput"]
    subprocess.run(collect, cwd=REPO, env=env, check=True, capture_output=True, timeout=120)
    port = free_port()
    argv = [
        sys.executable, "-m", "granian", "--interface", "wsgi", "--host", "127.0.0.1",
        "--port", str(port), "--workers", "2", "--blocking-threads", "32", "--no-ws",
        "project.wsgi:application",
    ]  # fmt: skip
    server = processes.start("api", argv, cwd=REPO, env=env, ports=(port,), inherit_output=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/admin/login/", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    try:
        wait_until(up, 30, "granian")
        yield url
    finally:
        processes.stop(server)


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The generated requests' tally (tests/fuzz_tally.py), when a run generated any."""
    from tests.fuzz_tally import GENERATED

    if GENERATED:
        kinds = ", ".join(f"{kind}: {n}" for kind, n in sorted(GENERATED.items()))
        terminalreporter.write_line(f"generated requests: {sum(GENERATED.values())} ({kinds})")
