"""`python -m devtools.demo`: the whole stack locally, a burst of prompts, then serving."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from django.conf import settings
from django.db import connection

from contract import liveness
from devtools.demo_prompts import (
    MAX_TOKENS,
    MODEL_NAME,
    listed_models,
    results_table,
    send_prompts,
    summary,
)
from devtools.demo_setup import (
    ADMIN_USER,
    POOL,
    TENANT,
    DemoError,
    build_model,
    ensure_admin_user,
    ensure_redis,
    migrate_database,
    say,
    seed_tenant,
    state_dir,
)
from llmqueue.redis_client import get_redis
from workers import processes
from workers.engines import EngineOptions
from workers.options import SlotOptions
from workers.pool import worker_processes
from workers.processes import Child, signals_as_interrupt, signals_ignored

PROMPT_COUNT = 36
CONCURRENCY = 12
WORKER_LIVE_TIMEOUT_SECONDS = 180.0
WEB_READY_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 30.0
DEFAULT_PORT = 8000


# --- processes -------------------------------------------------------------------------------


def log_tail(child: Child, lines: int = 20) -> str:
    tail = child.log_tail(lines)
    if not tail:
        return ""
    return f"\nlast lines of {child.log_path}:\n" + "\n".join(
        f"  {line}" for line in tail.splitlines()
    )


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Children must use the server this process checked (or started), whatever .env says.
    env["REDIS_URL"] = settings.REDIS_URL
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_child(name: str, argv: list[str], log: Path, ports: tuple[int, ...] = ()) -> Child:
    """In its own process group (workers/processes.py): Ctrl-C reaches only the demo, which stops
    its children in order (web, worker, then the Redis they both use)."""
    return processes.start(
        name, argv, env=child_env(), cwd=settings.BASE_DIR, log_path=log, ports=ports
    )


def exited_error(child: Child) -> DemoError:
    return DemoError(f"The {child.name} exited with status {child.returncode}.{log_tail(child)}")


def stop_children(children: list[Child]) -> None:
    """Newest first; SIGTERM (a warm shutdown for the worker), SIGKILL if it hangs, then its
    process group, which must not outlive it (the worker's engine core)."""
    for child in reversed(children):
        say(f"stopping {child.name} (pid {child.pid})")
        processes.stop(child, grace_seconds=STOP_TIMEOUT_SECONDS, on_kill=_say_killed)


def _say_killed(child: Child) -> None:
    say(f"  {child.name} did not stop within {STOP_TIMEOUT_SECONDS:g} s: killing it")


def wait_until(child: Child, ready: Callable[[], bool], timeout_seconds: float, what: str) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not ready():
        if not child.running():
            raise exited_error(child)
        if time.monotonic() > deadline:
            raise DemoError(f"{what} not within {timeout_seconds:g} s.{log_tail(child)}")
        time.sleep(0.5)


# --- the worker and the web server -----------------------------------------------------------


def worker_argv(model_path: Path) -> list[str]:
    """The one CPU worker `manage.py runworkers` would start for these options (its node name
    included), started here directly: one process less to supervise."""
    engine = EngineOptions(
        kind="vllm",
        model=str(model_path),
        served_model_name=MODEL_NAME,
        in_process=True,
        enforce_eager=True,
        max_num_seqs=32,
        dtype="float32",
        gpu_memory_utilization=0.1,
        max_model_len=2048,
    )
    slots = SlotOptions(pool=POOL, loglevel="WARNING")
    return worker_processes([], 1, [], engine, slots)[0].argv


def live_nodes() -> list[str]:
    return liveness.live_workers(get_redis(), POOL, settings.LLMQUEUE_WORKER_STALE_SECONDS)


def start_worker(children: list[Child], model_path: Path) -> None:
    log = state_dir() / "logs" / "demo-worker.log"
    say(
        f"[5/7] starting a worker on pool {POOL!r} and loading the model into vLLM (the first "
        f"load on a fresh machine compiles kernels: up to a minute); log: {log}"
    )
    child = start_child("worker", worker_argv(model_path), log)
    children.append(child)
    started = time.monotonic()
    wait_until(
        child, lambda: bool(live_nodes()), WORKER_LIVE_TIMEOUT_SECONDS, "The worker was live"
    )
    say(f"      worker {', '.join(live_nodes())} is live after {time.monotonic() - started:.0f} s")


def choose_port(preferred: int) -> int:
    if processes.port_is_free(preferred):
        return preferred
    port = processes.free_port()
    say(f"      port {preferred} is taken: using {port}")
    return port


def web_argv(port: int) -> list[str]:
    # --insecure: serve the admin's static files although DEBUG is off.
    return [
        sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload", "--insecure",
    ]  # fmt: skip


def start_web(children: list[Child], preferred_port: int, key: str) -> str:
    port = choose_port(preferred_port)
    log = state_dir() / "logs" / "demo-web.log"
    base_url = f"http://127.0.0.1:{port}"
    say(f"[6/7] starting the web server at {base_url}; log: {log}")
    child = start_child("web server", web_argv(port), log, ports=(port,))
    children.append(child)
    # Batches' lines are released into the broker by the pacer, a program of its own.
    pacer_log = state_dir() / "logs" / "demo-bulk-pacer.log"
    say(f"      and the bulk pacer (manage.py bulk_pacer); log: {pacer_log}")
    children.append(
        start_child("bulk pacer", [sys.executable, "manage.py", "bulk_pacer"], pacer_log)
    )
    wait_until(
        child,
        lambda: MODEL_NAME in listed_models(base_url, key),
        WEB_READY_TIMEOUT_SECONDS,
        f"The web server listed {MODEL_NAME!r} at {base_url}/v1/models",
    )
    return base_url


def run_prompts(base_url: str, key: str) -> None:
    say(f"[7/7] sending {PROMPT_COUNT} prompts, {CONCURRENCY} at a time, max_tokens {MAX_TOKENS}")
    started = time.monotonic()
    outcomes = send_prompts(base_url, key, PROMPT_COUNT, CONCURRENCY)
    elapsed = time.monotonic() - started
    say("      (a random tiny model: the text is gibberish; the queue around it is the point)")
    say(results_table(outcomes))
    say(summary(outcomes, elapsed))
    failed = [o for o in outcomes if not o.succeeded]
    if failed:
        raise DemoError(f"{len(failed)} of {len(outcomes)} prompts failed: {failed[0].error}")


# --- the whole demo ---------------------------------------------------------------------------


def print_access(base_url: str, key: str, admin_password: str | None) -> None:
    if admin_password is None:
        login = (
            f"user {ADMIN_USER!r} (exists already; set a password with "
            f"`python manage.py changepassword {ADMIN_USER}`)"
        )
    else:
        login = f"user {ADMIN_USER!r}, password {admin_password} (shown only now)"
    body = json.dumps(
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16}
    )
    say("")
    say(f"admin  {base_url}/admin/   log in as {login}")
    say(f"API    {base_url}/v1/   key {key} (tenant {TENANT!r}, tier interactive)")
    say("try:")
    say(f"  curl -s {base_url}/v1/chat/completions \\")
    say(f"    -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\")
    say(f"    -d '{body}'")


def serve_until_interrupted(children: list[Child]) -> None:
    say("\nserving; press Ctrl-C to stop")
    while True:
        for child in children:
            if not child.running():
                raise exited_error(child)
        time.sleep(1.0)


def set_up(children: list[Child], preferred_port: int) -> tuple[str, str, str | None]:
    """Steps 1 to 6; (base URL, API key, new admin password or None)."""
    migrate_database()
    ensure_redis(children)
    model_path = build_model()
    key = seed_tenant()
    admin_password = ensure_admin_user()
    # The children open their own connections; SQLite needs no handle kept open here.
    connection.close()
    start_worker(children, model_path)
    return start_web(children, preferred_port, key), key, admin_password


def run_demo(preferred_port: int, exit_after_results: bool) -> None:
    """Run every step; on any exit (error, Ctrl-C, SIGTERM) stop what it started, newest first."""
    children: list[Child] = []
    with signals_as_interrupt():
        try:
            base_url, key, admin_password = set_up(children, preferred_port)
            run_prompts(base_url, key)
            print_access(base_url, key, admin_password)
            if not exit_after_results:
                try:
                    serve_until_interrupted(children)
                except KeyboardInterrupt:
                    say("")
        finally:
            with signals_ignored():
                stop_children(children)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.demo",
        description="Migrate, start Redis if none answers (embedded, AOF under .llmqueue/), build "
        "a tiny model, start a vLLM CPU worker and the web server, send a burst of prompts "
        "through the API, then serve until Ctrl-C.",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=int(os.environ.get("DEMO_PORT", str(DEFAULT_PORT))),
        help="web server port, another free one if taken (env DEMO_PORT; default 8000)",
    )
    parser.add_argument(
        "--exit",
        action="store_true",
        default=os.environ.get("DEMO_EXIT", "").strip().lower() in {"1", "true", "yes"},
        help="stop after the burst instead of serving (env DEMO_EXIT=1)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    # The demo may run without a SECRET_KEY (settings refuse to elsewhere); its children inherit.
    os.environ.setdefault("LLMQUEUE_DEMO", "true")
    import django

    django.setup()
    try:
        run_demo(args.port, args.exit)
    except DemoError as exc:
        print(f"CommandError: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
