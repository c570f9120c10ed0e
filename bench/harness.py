"""Benchmark plumbing: a dedicated DB + Redis db, seeding, and the child processes under test.

Everything a benchmark starts is stopped again by PID and process group (never by name;
workers/processes.py), and it only ever flushes
the one Redis database number it was given, so it can share a Redis server with other users.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from contract.liveness import live_workers
from workers import command, processes
from workers.engines import EngineOptions
from workers.options import SlotOptions

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
PYTHON = sys.executable
REDIS_BASE_URL = "redis://127.0.0.1:6379"
DEFAULT_STALE_SECONDS = 10.0


# --- addresses ---------------------------------------------------------------------------------
free_port = processes.free_port


def redis_url(db: int, base: str = REDIS_BASE_URL) -> str:
    return f"{base.rstrip('/')}/{db}"


def flush_redis(url: str) -> None:
    """FLUSHDB on exactly the database named by `url` (never FLUSHALL: the server is shared)."""
    client = redis.Redis.from_url(url)
    try:
        client.flushdb()
    finally:
        client.close()


# --- the bench database ------------------------------------------------------------------------
@dataclass
class BenchDatabase:
    """Where the benchmark's Django state lives; `cleanup` removes it."""

    url: str
    kind: str  # "sqlite" | "postgresql"
    tmpdir: Path | None = None

    def cleanup(self) -> None:
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)


def sqlite_database(prefix: str = "llmqueue-bench-") -> BenchDatabase:
    tmpdir = Path(tempfile.mkdtemp(prefix=prefix))
    # Four slashes: sqlite:/// + an absolute path.
    return BenchDatabase(f"sqlite:///{tmpdir / 'db.sqlite3'}", "sqlite", tmpdir)


def _psql(base_url: str, sql: str) -> str:
    """Run `sql` with psql against the server of `base_url` (maintenance DB `postgres`)."""
    parts = urlsplit(base_url)
    argv = ["psql", "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1"]
    argv += ["-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 5432)]
    argv += ["-U", parts.username or "postgres", "-d", "postgres", "-c", sql]
    env = dict(os.environ)
    if parts.password:
        env["PGPASSWORD"] = parts.password
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=60)
    return done.stdout.strip()


def postgres_database(base_url: str, name: str) -> BenchDatabase:
    """A fresh PostgreSQL database `name` on the server of `base_url` (dropped and recreated, so
    every run starts from the same empty table)."""
    if not name.replace("_", "").isalnum():
        raise ValueError(f"unsafe database name {name!r}")
    _psql(base_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    _psql(base_url, f'CREATE DATABASE "{name}"')
    parts = urlsplit(base_url)
    return BenchDatabase(urlunsplit(parts._replace(path=f"/{name}")), "postgresql")


def bench_database(name: str, url: str | None = None) -> BenchDatabase:
    """PostgreSQL (database `name` on the server of `url` or $DATABASE_URL) when one is given,
    else a temporary SQLite file."""
    url = url or os.environ.get("DATABASE_URL")
    if url and url.startswith(("postgres://", "postgresql://", "pgsql://")):
        return postgres_database(url, name)
    if url and url.startswith("sqlite:"):
        return BenchDatabase(url, "sqlite")
    if url:
        raise ValueError(f"unsupported DATABASE_URL for benchmarks: {url}")
    return sqlite_database()


def bench_env(database: BenchDatabase, redis: str, **extra: str) -> dict[str, str]:
    """The environment of every child: our DB and Redis db, production-like settings."""
    env = dict(os.environ)
    env.setdefault("SECRET_KEY", "bench-only-secret-key-not-for-production-use-0123456789")
    env.update(
        DJANGO_SETTINGS_MODULE="project.settings",
        DATABASE_URL=database.url,
        REDIS_URL=redis,
        DEBUG="false",
        LOG_LEVEL="WARNING",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


def migrate(env: dict[str, str]) -> None:
    subprocess.run(
        [PYTHON, "manage.py", "migrate", "--noinput", "-v", "0"],
        cwd=REPO,
        env=env,
        check=True,
        timeout=300,
    )


def seed(
    env: dict[str, str],
    *,
    model: str = "sim",
    pool: str = "default",
    tenant: str = "bench",
    tier: str = "interactive",
    context_length: int = 2048,
    max_tokens: int = 512,
    limits: dict[str, Any] | None = None,
) -> str:
    """Create tiers, the served model and a tenant in the bench DB; returns the tenant's API key."""
    tenants = [{"name": tenant, "tier": tier, "limits": limits or {}}]
    keys = seed_tenants(
        env, tenants, model=model, pool=pool, context_length=context_length, max_tokens=max_tokens
    )
    return keys[tenant]


def seed_tenants(
    env: dict[str, str],
    tenants: list[dict[str, Any]],
    *,
    model: str = "sim",
    pool: str = "default",
    context_length: int = 2048,
    max_tokens: int = 512,
    tiers: dict[str, dict[str, Any]] | None = None,
) -> dict[str, str]:
    """Create the default tiers (with `tiers` {name: {field: value}} applied), the served model
    and each tenant ({"name", "tier", "limits"}); returns {tenant name: API key}.

    Runs in a subprocess so the benchmark process itself never binds to a Django database.
    """
    spec = {
        "model": model,
        "pool": pool,
        "context_length": context_length,
        "max_tokens": max_tokens,
        "tenants": tenants,
        "tiers": tiers or {},
    }
    return dict(_harness_command(env, ["seed", json.dumps(spec)], 120))


def _harness_command(env: dict[str, str], args: list[str], timeout_seconds: float) -> Any:
    """Run `python -m bench.harness ARGS` in the bench's environment; its last line is JSON."""
    done = subprocess.run(
        [PYTHON, "-m", "bench.harness", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=timeout_seconds,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _seed_main(spec_json: str) -> None:
    import django

    django.setup()
    from llmqueue.defaults import create_tenant_with_key, ensure_default_tiers, ensure_served_model
    from llmqueue.models import Tier

    spec = json.loads(spec_json)
    ensure_default_tiers()
    for name, fields in spec["tiers"].items():
        Tier.objects.update_or_create(name=name, defaults=fields)
    tiers = {tier.name: tier for tier in Tier.objects.all()}
    ensure_served_model(spec["model"], spec["pool"], spec["context_length"], spec["max_tokens"])
    keys = {}
    for tenant in spec["tenants"]:
        _, keys[tenant["name"]] = create_tenant_with_key(
            tenant["name"], tiers[tenant["tier"]], **tenant["limits"]
        )
    print(json.dumps(keys))


def tiny_model_path(given: str = "") -> str:
    """`given`, or the tiny local model the tests use (built under .llmqueue/ on first use)."""
    if given:
        return given
    from devtools.tiny_model import build_tiny_model

    return str(build_tiny_model(REPO / ".llmqueue" / "models" / "tiny-llama"))


def write_result(path: Path, result: dict[str, Any], report: str) -> None:
    """Write a benchmark's result as JSON to `path`, then print it and its human report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(report)


# --- child processes: workers/processes.py, the one supervisor -------------------------------
Child = processes.Child


def start_process(
    name: str, argv: Sequence[str], env: dict[str, str], log_path: Path | None = None
) -> Child:
    """Start `argv` in its own process group (a Ctrl-C in the terminal reaches only the
    benchmark, which then stops its children in order), output appended to `log_path`."""
    return processes.start(name, argv, env=env, cwd=REPO, log_path=log_path)


def stop_process(child: Child, grace_seconds: float = 15.0) -> int | None:
    """SIGTERM (warm shutdown for Celery, graceful for gunicorn), SIGKILL after `grace_seconds`,
    then whatever it started and left behind (a vLLM engine-core process outlives a killed
    worker): its process group and the PIDs found below it before the stop."""
    return processes.stop(child, grace_seconds=grace_seconds)


def children() -> AbstractContextManager[list[Child]]:
    """A list to append started children to; all are stopped, newest first, on the way out."""
    return processes.supervised()


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks stop the children and flush Redis."""

    def _raise(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by `pid` and its live descendants (Linux /proc)."""
    return sum(processes.cpu_seconds(member) for member in processes.descendants(pid))


def machine_busy_seconds() -> float:
    """CPU seconds all cores of this machine spent busy so far (/proc/stat; idle and iowait
    excluded), to tell how much of the machine other users took during a measurement."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    # guest time is already counted in user/nice
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _check_alive(child: Child) -> None:
    if not child.running():
        raise RuntimeError(
            f"{child.name} (pid {child.pid}) exited with status {child.popen.returncode}:\n"
            f"{child.log_tail()}"
        )


def wait_for_workers(
    url: str,
    pool: str,
    count: int,
    started: Sequence[Child],
    timeout_seconds: float = 60.0,
    stale_seconds: float = DEFAULT_STALE_SECONDS,
) -> list[str]:
    """Block until `count` workers of `pool` beat in Redis; fail fast if a child died."""
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout_seconds
    try:
        while True:
            nodes = live_workers(client, pool, stale_seconds)
            if len(nodes) >= count:
                return nodes
            for child in started:
                _check_alive(child)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(nodes)}/{count} workers of pool {pool!r} live")
            time.sleep(0.1)
    finally:
        client.close()


def wait_for_http(
    host: str, port: int, child: Child, path: str = "/v1/models", timeout_seconds: float = 30.0
) -> int:
    """Block until the server answers `path` with any HTTP status (401 counts: it is up)."""
    deadline = time.monotonic() + timeout_seconds
    while True:
        _check_alive(child)
        conn = http.client.HTTPConnection(host, port, timeout=2)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            response.read()
            return response.status
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
        finally:
            conn.close()


# --- the processes under test ------------------------------------------------------------------
def worker_argv(
    *,
    model: str = "sim",
    pool: str = "default",
    time_scale: float = 0.0,
    max_num_seqs: int = 64,
    slots: int = 0,
    loglevel: str = "WARNING",
    node_name: str = "",
    dispatch: str = "",
    token_budget: int = 0,
    bulk_reserve: int = 0,
) -> list[str]:
    """One simulated-engine GPU worker (`workers.serve`); `dispatch`, `token_budget` and
    `bulk_reserve` default to the worker's own defaults."""
    engine = EngineOptions(
        kind="simulated", model=model, sim_time_scale=time_scale, max_num_seqs=max_num_seqs
    )
    slot_options = SlotOptions(
        pool=pool, slots=slots, loglevel=loglevel, token_budget=token_budget,
        bulk_reserve=bulk_reserve,
    )  # fmt: skip
    if dispatch:
        slot_options = replace(slot_options, dispatch=dispatch)
    return command.worker_argv(engine, slot_options, node=node_name)


@dataclass(frozen=True)
class ApiServer:
    """How the API runs (recorded with the results): granian (default) or gunicorn, WSGI.

    granian (a Rust HTTP server) hands a request to the Django app in ~0.8 ms on this machine
    where gunicorn's gthread worker takes ~1.5 ms (a no-op Django view, lean client, measured
    side by side); both keep connections alive, as the openai SDK's pool expects. Each blocking
    API call holds one of `threads` while it waits for its result.
    """

    server: str = "granian"
    worker_class: str = "gthread"  # gunicorn only
    workers: int = 1
    threads: int = 8
    keepalive_seconds: int = 30
    config: str = ""  # optional gunicorn config file (e.g. timing hooks while investigating)

    def argv(self, host: str, port: int) -> list[str]:
        if self.server == "granian":
            argv = [PYTHON, "-m", "granian", "--interface", "wsgi", "--host", host]
            argv += ["--port", str(port), "--workers", str(self.workers)]
            argv += ["--blocking-threads", str(self.threads), "--no-ws", "--log-level", "warning"]
            return [*argv, "project.wsgi:application"]
        argv = [PYTHON, "-m", "gunicorn", "project.wsgi:application"]
        argv += ["--bind", f"{host}:{port}", "--workers", str(self.workers)]
        argv += ["--worker-class", self.worker_class, "--threads", str(self.threads)]
        argv += ["--keep-alive", str(self.keepalive_seconds), "--log-level", "warning"]
        if self.config:
            argv += ["--config", self.config]
        return argv

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "server": self.server,
            "app": "project.wsgi:application",
            "workers": self.workers,
            "threads": self.threads,
        }
        if self.server == "gunicorn":
            out.update(worker_class=self.worker_class, keepalive_seconds=self.keepalive_seconds)
        return out


def request_timeline(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Every PromptRequest in the bench DB: id → status and epoch seconds of enqueue, claim, first
    token and finish (the server's own timeline, to split a client-side latency into its parts),
    with its deadline, tenant, tier and token counts (for the scheduling bench)."""
    return dict(_harness_command(env, ["timeline"], 300))


def _timeline_main() -> None:
    import django

    django.setup()
    from llmqueue.models import PromptRequest

    def epoch(value: Any) -> float | None:
        return None if value is None else float(value.timestamp())

    rows = PromptRequest.objects.values(
        "id", "status", "enqueued_at", "started_at", "finished_at", "first_token_at",
        "deadline_at", "tenant__name", "tier__name", "prompt_tokens", "completion_tokens",
    )  # fmt: skip
    print(
        json.dumps(
            {
                str(row["id"]): {
                    "status": row["status"],
                    "enqueued": epoch(row["enqueued_at"]),
                    "started": epoch(row["started_at"]),
                    "finished": epoch(row["finished_at"]),
                    "first_token": epoch(row["first_token_at"]),
                    "deadline": epoch(row["deadline_at"]),
                    "tenant": row["tenant__name"],
                    "tier": row["tier__name"],
                    "prompt_tokens": row["prompt_tokens"],
                    "completion_tokens": row["completion_tokens"],
                }
                for row in rows.iterator(chunk_size=2000)
            }
        )
    )


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "seed":
        _seed_main(sys.argv[2])
    elif len(sys.argv) == 2 and sys.argv[1] == "timeline":
        _timeline_main()
    else:
        sys.exit("usage: python -m bench.harness seed SPEC_JSON | timeline")
