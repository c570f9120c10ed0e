"""`python -m devtools.demo`: the whole stack locally, a burst of prompts, then serving."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection

from devtools.embedded_redis import (
    EmbeddedRedisError,
    local_port,
    redact,
    start_embedded_redis,
)
from llmqueue import liveness
from llmqueue.redis_client import get_redis

MODEL_NAME = "tiny-llama"
POOL = "default"
TENANT = "demo"
ADMIN_USER = "admin"
PROMPT_COUNT = 36
CONCURRENCY = 12
MAX_TOKENS = 32
WORKER_LIVE_TIMEOUT_SECONDS = 180.0
WEB_READY_TIMEOUT_SECONDS = 30.0
HTTP_TIMEOUT_SECONDS = 120.0
STOP_TIMEOUT_SECONDS = 30.0
MAX_RETRIES = 5
REQUEST_ID_HEADER = "X-LLMQueue-Request-Id"
DEFAULT_PORT = 8000

_SEEDS = (
    "the quick brown fox",
    "a queue decides who gets the gpu",
    "hello world, how are you?",
    "one two three four five",
    "tenants send prompts",
    "workers batch them",
    "results come back",
    "llmqueue admits, routes and serves",
    "the lazy dog",
)


class DemoError(RuntimeError):
    """A demo step failed; the message says which and why."""


@dataclass
class Child:
    """A process the demo started and must stop."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path | None = None


@dataclass(frozen=True)
class PromptOutcome:
    index: int
    endpoint: str
    status: int
    request_id: str
    completion_tokens: int
    text: str
    error: str = ""

    @property
    def succeeded(self) -> bool:
        return self.status == 200


def say(message: str) -> None:
    print(message, flush=True)


# --- processes -------------------------------------------------------------------------------


def log_tail(path: Path | None, lines: int = 20) -> str:
    if path is None or not path.exists():
        return ""
    tail = path.read_text(errors="replace").splitlines()[-lines:]
    return f"\nlast lines of {path}:\n" + "\n".join(f"  {line}" for line in tail)


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Children must use the server this process checked (or started), whatever .env says.
    env["REDIS_URL"] = settings.REDIS_URL
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_child(name: str, argv: list[str], log: Path) -> Child:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            cwd=settings.BASE_DIR,
            env=child_env(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            # Own process group: Ctrl-C reaches only the demo, which stops its children in order
            # (web, worker, then the Redis they both use).
            process_group=0,
        )
    return Child(name, process, log)


def exited_error(child: Child) -> DemoError:
    return DemoError(
        f"The {child.name} exited with status {child.process.returncode}.{log_tail(child.log)}"
    )


def stop_child(child: Child, timeout_seconds: float = STOP_TIMEOUT_SECONDS) -> None:
    """SIGTERM (a warm shutdown for the worker, which forwards it), then SIGKILL if it hangs."""
    process = child.process
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            say(f"  {child.name} did not stop within {timeout_seconds:g} s: killing it")
            process.kill()
            process.wait()
    # The group is the one start_child created for this child: it also holds what the child
    # started (runworkers' worker), which must not outlive a killed parent.
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def stop_children(children: list[Child]) -> None:
    for child in reversed(children):
        say(f"stopping {child.name} (pid {child.process.pid})")
        stop_child(child)


@contextmanager
def _stop_signals_handled(handler: Any) -> Iterator[None]:
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def signals_as_interrupt() -> AbstractContextManager[None]:
    """SIGINT and SIGTERM stop the demo the same way, so the cleanup below runs for both (SIGINT
    too, since a shell starts background jobs with it ignored)."""
    return _stop_signals_handled(_interrupt)


def signals_ignored() -> AbstractContextManager[None]:
    """While the demo stops what it started: a second Ctrl-C must not cut that short, or the
    worker (in its own process group, holding the engine) outlives the demo."""
    return _stop_signals_handled(signal.SIG_IGN)


# --- setup steps ----------------------------------------------------------------------------


def migrate_database() -> None:
    db = settings.DATABASES["default"]
    say(f"[1/7] migrating the database ({connection.vendor}: {db['NAME']})")
    call_command("migrate", interactive=False, verbosity=0)


def redis_data_dir(url: str) -> Path:
    # One folder per port: a second embedded server (e.g. the test's) never shares AOF files.
    return Path(settings.STATE_DIR) / "redis" / str(local_port(url) or "remote")


def ensure_redis(children: list[Child]) -> None:
    url = settings.REDIS_URL
    data_dir = redis_data_dir(url)
    try:
        process = start_embedded_redis(url, data_dir)
    except EmbeddedRedisError as exc:
        raise DemoError(str(exc)) from exc
    if process is None:
        say(f"[2/7] Redis answers at {redact(url)}")
    else:
        say(f"[2/7] started an embedded Redis at {url} (pid {process.pid}, AOF in {data_dir})")
        children.append(Child("embedded Redis", process, data_dir / "server.log"))


def build_model() -> Path:
    from devtools.tiny_model import build_tiny_model

    path = Path(settings.STATE_DIR) / "models" / MODEL_NAME
    say(f"[3/7] tiny local model at {path}")
    return build_tiny_model(path)


def seed_tenant() -> str:
    """Tiers, the served model and the demo tenant; returns a new API key for it."""
    from llmqueue.defaults import create_tenant_with_key, ensure_default_tiers, ensure_served_model

    tiers = ensure_default_tiers()
    ensure_served_model(name=MODEL_NAME, pool=POOL, context_length=2048, max_tokens=512)
    # Room for the whole burst at once, whatever the tenant defaults are.
    _, key = create_tenant_with_key(
        TENANT, tiers["interactive"], requests_per_second=100.0, burst=100
    )
    say(f"[4/7] tiers {', '.join(tiers)}; model {MODEL_NAME!r} on pool {POOL!r}; tenant {TENANT!r}")
    return key


def ensure_admin_user() -> str | None:
    """Create the admin superuser with a random password (returned once); None if it exists."""
    users = get_user_model()
    if users.objects.filter(username=ADMIN_USER).exists():
        return None
    password = secrets.token_urlsafe(12)
    users.objects.create_superuser(ADMIN_USER, "", password)
    return password


def worker_argv(model_path: Path) -> list[str]:
    return [
        sys.executable, "manage.py", "runworkers",
        "--engine", "vllm",
        "--model", str(model_path),
        "--in-process",
        "--enforce-eager",
        "--max-num-seqs", "32",
        "--dtype", "float32",
        "--gpu-memory-utilization", "0.1",
        "--max-model-len", "2048",
        "--pool", POOL,
        "--loglevel", "WARNING",
    ]  # fmt: skip


def wait_until(child: Child, ready: Callable[[], bool], timeout_seconds: float, what: str) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not ready():
        if child.process.poll() is not None:
            raise exited_error(child)
        if time.monotonic() > deadline:
            raise DemoError(f"{what} not within {timeout_seconds:g} s.{log_tail(child.log)}")
        time.sleep(0.5)


def start_worker(children: list[Child], model_path: Path) -> None:
    log = Path(settings.STATE_DIR) / "logs" / "demo-worker.log"
    say(
        f"[5/7] starting a worker on pool {POOL!r} and loading the model into vLLM (the first "
        f"load on a fresh machine compiles kernels: up to a minute); log: {log}"
    )
    child = start_child("worker", worker_argv(model_path), log)
    children.append(child)
    client = get_redis()
    started = time.monotonic()
    wait_until(
        child,
        lambda: bool(liveness.live_workers(client, POOL, settings.LLMQUEUE_WORKER_STALE_SECONDS)),
        WORKER_LIVE_TIMEOUT_SECONDS,
        "The worker was live",
    )
    nodes = liveness.live_workers(client, POOL, settings.LLMQUEUE_WORKER_STALE_SECONDS)
    say(f"      worker {', '.join(nodes)} is live after {time.monotonic() - started:.0f} s")


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the server will: a port in TIME_WAIT is free for it.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def choose_port(preferred: int) -> int:
    if port_is_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    say(f"      port {preferred} is taken: using {port}")
    return port


def web_argv(port: int) -> list[str]:
    # --insecure: serve the admin's static files although DEBUG is off.
    return [
        sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload", "--insecure",
    ]  # fmt: skip


def listed_models(base_url: str, key: str) -> list[str]:
    status, body, _ = http_json("GET", f"{base_url}/v1/models", key, None, timeout_seconds=2.0)
    if status != 200:
        return []
    return [m["id"] for m in body.get("data", [])]


def start_web(children: list[Child], preferred_port: int, key: str) -> str:
    port = choose_port(preferred_port)
    log = Path(settings.STATE_DIR) / "logs" / "demo-web.log"
    base_url = f"http://127.0.0.1:{port}"
    say(f"[6/7] starting the web server at {base_url}; log: {log}")
    child = start_child("web server", web_argv(port), log)
    children.append(child)
    wait_until(
        child,
        lambda: MODEL_NAME in listed_models(base_url, key),
        WEB_READY_TIMEOUT_SECONDS,
        f"The web server listed {MODEL_NAME!r} at {base_url}/v1/models",
    )
    return base_url


# --- the burst of prompts ------------------------------------------------------------------


def http_json(
    method: str, url: str, key: str, body: dict[str, Any] | None, timeout_seconds: float
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, headers); status 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {key}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_seconds) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        raw = error.read()
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"error": {"message": raw.decode(errors="replace")[:200]}}
        return error.code, parsed, dict(error.headers)
    except (OSError, ValueError) as exc:
        return 0, {"error": {"message": str(exc)}}, {}


def prompt_requests(count: int) -> list[tuple[str, dict[str, Any]]]:
    """(endpoint, body) pairs: completions and chat completions, alternating."""
    requests: list[tuple[str, dict[str, Any]]] = []
    for i in range(count):
        seed = _SEEDS[i % len(_SEEDS)]
        if i % 2 == 0:
            body: dict[str, Any] = {"model": MODEL_NAME, "prompt": seed, "max_tokens": MAX_TOKENS}
            requests.append(("completions", body))
        else:
            messages = [{"role": "user", "content": seed}]
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_TOKENS}
            requests.append(("chat/completions", body))
    return requests


def completion_text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def send_prompt(
    base_url: str, key: str, index: int, endpoint: str, body: dict[str, Any]
) -> PromptOutcome:
    """One blocking request; 429/503 are retried after Retry-After, as the openai SDK does."""
    for _attempt in range(MAX_RETRIES):
        status, reply, headers = http_json(
            "POST", f"{base_url}/v1/{endpoint}", key, body, HTTP_TIMEOUT_SECONDS
        )
        if status not in (429, 503):
            break
        time.sleep(float(headers.get("Retry-After", "1")))
    request_id = headers.get(REQUEST_ID_HEADER, "")
    if status != 200:
        message = str(reply.get("error", {}).get("message", reply))
        return PromptOutcome(index, endpoint, status, request_id, 0, "", message)
    tokens = int(reply["usage"]["completion_tokens"])
    return PromptOutcome(index, endpoint, status, request_id, tokens, completion_text(reply))


def send_prompts(base_url: str, key: str, count: int, concurrency: int) -> list[PromptOutcome]:
    from tqdm import tqdm

    outcomes = []
    with (
        ThreadPoolExecutor(max_workers=concurrency) as pool,
        tqdm(total=count, desc="      prompts", unit="req") as bar,
    ):
        futures = [
            pool.submit(send_prompt, base_url, key, i, endpoint, body)
            for i, (endpoint, body) in enumerate(prompt_requests(count))
        ]
        for future in as_completed(futures):
            outcomes.append(future.result())
            bar.update()
    return sorted(outcomes, key=lambda o: o.index)


def results_table(outcomes: list[PromptOutcome], rows: int = 8) -> str:
    shown = outcomes[:rows] + [o for o in outcomes[rows:] if not o.succeeded]
    lines = [f"      {'#':>3}  {'endpoint':<17} {'request id':<10} {'HTTP':>4} {'tokens':>6}  text"]
    for o in shown:
        text = o.text if o.succeeded else f"error: {o.error}"
        # A random model emits any byte: keep the table one printable line per row.
        text = "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)[:48]
        lines.append(
            f"      {o.index:>3}  {o.endpoint:<17} {o.request_id[:8]:<10} {o.status:>4} "
            f"{o.completion_tokens:>6}  {text}"
        )
    if len(outcomes) > len(shown):
        lines.append(f"      … and {len(outcomes) - len(shown)} more")
    return "\n".join(lines)


def summary(outcomes: list[PromptOutcome], elapsed_seconds: float) -> str:
    succeeded = sum(o.succeeded for o in outcomes)
    tokens = sum(o.completion_tokens for o in outcomes)
    line = (
        f"      {succeeded}/{len(outcomes)} prompts succeeded, {tokens} tokens generated in "
        f"{elapsed_seconds:.1f} s ({len(outcomes) / elapsed_seconds:.1f} requests/s)"
    )
    failures = Counter(o.status for o in outcomes if not o.succeeded)
    if failures:
        line += "; failed: " + ", ".join(f"{n} x HTTP {s}" for s, n in sorted(failures.items()))
    return line


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
            if child.process.poll() is not None:
                raise exited_error(child)
        time.sleep(1.0)


def run_demo(preferred_port: int, exit_after_results: bool) -> None:
    """Run every step; on any exit (error, Ctrl-C, SIGTERM) stop what it started, newest first."""
    children: list[Child] = []
    with signals_as_interrupt():
        try:
            migrate_database()
            ensure_redis(children)
            model_path = build_model()
            key = seed_tenant()
            admin_password = ensure_admin_user()
            # The children open their own connections; SQLite needs no handle kept open here.
            connection.close()
            start_worker(children, model_path)
            base_url = start_web(children, preferred_port, key)
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
