"""Child processes: own process group, stop by PID/group (grace, SIGKILL), free ports, signals."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DEFAULT_GRACE_SECONDS = 15.0
PORT_FREE_SECONDS = 10.0

SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


@dataclass
class Child:
    """A process we started; only its PID and the process group it leads are ever signalled."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path | None = None
    ports: tuple[int, ...] = ()
    # The process group it leads, when started in its own: kept, since a child already reaped
    # can no longer be asked for it (the kernel reuses no PID while its group has members).
    group: int | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.returncode

    def running(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def start(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    log_path: Path | None = None,
    ports: Iterable[int] = (),
    own_group: bool = True,
    inherit_output: bool = False,
) -> Child:
    """Start `argv`, output to `log_path` (else discarded, or ours with `inherit_output`), in
    its own process group: a terminal's Ctrl-C reaches only the caller, which stops its children
    in its own order, and `stop` can reach whatever the child starts. `ports`: the ones `stop`
    waits to see freed."""
    log = None
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("wb")
    popen = subprocess.Popen(
        list(argv),
        cwd=cwd,
        env=None if env is None else dict(env),
        stdin=subprocess.DEVNULL,
        stdout=_output(log, inherit_output),
        stderr=None if inherit_output and log is None else subprocess.STDOUT,
        process_group=0 if own_group else None,
    )
    return Child(name, popen, log_path, tuple(ports), popen.pid if own_group else None, log)


def _output(log: IO[bytes] | None, inherit: bool) -> IO[bytes] | int | None:
    if log is not None:
        return log
    return None if inherit else subprocess.DEVNULL


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds process `pid` used so far (Linux /proc; 0 where unreadable)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it (Linux /proc; just `pid` elsewhere)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(parents.get(current, []))
    return found


def _signal_leader(popen: subprocess.Popen[bytes], sig: int, grace_seconds: float) -> bool:
    """`sig` to the child's PID, then SIGKILL if it has not exited within `grace_seconds`;
    whether it had to be killed."""
    if popen.poll() is not None:
        return False
    with contextlib.suppress(ProcessLookupError):
        popen.send_signal(sig)
    try:
        popen.wait(timeout=grace_seconds)
    except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
        return True
    return False


def _kill_leftovers(group: int | None, pids: Iterable[int]) -> None:
    """SIGKILL what the child left behind: the process group it led (a worker's vLLM engine
    core, granian's or gunicorn's workers), and the processes found below it before the stop,
    which may have left that group."""
    if group is not None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def stop(
    child: Child,
    sig: int = signal.SIGTERM,
    grace_seconds: float = DEFAULT_GRACE_SECONDS,
    on_kill: Callable[[Child], None] | None = None,
) -> int | None:
    """`sig` (SIGTERM: Celery's warm shutdown, a server's graceful one), SIGKILL after
    `grace_seconds` (then `on_kill` is told), then SIGKILL whatever it started; wait
    until its ports are free. Returns the child's exit status."""
    # Looked up before the stop: once it is reaped its PID may name another process.
    below = descendants(child.pid)[1:] if child.running() else []
    if _signal_leader(child.popen, sig, grace_seconds) and on_kill is not None:
        on_kill(child)
    _kill_leftovers(child.group, below)
    child.close_log()
    wait_ports_free(child.ports)
    return child.popen.returncode


def stop_all(children: Sequence[Child], grace_seconds: float = DEFAULT_GRACE_SECONDS) -> None:
    """Stop every child, newest first: servers before the Redis they use."""
    for child in reversed(children):
        stop(child, grace_seconds=grace_seconds)


@contextmanager
def supervised(grace_seconds: float = DEFAULT_GRACE_SECONDS) -> Iterator[list[Child]]:
    """A list to append started children to; all are stopped, newest first, on the way out."""
    started: list[Child] = []
    try:
        yield started
    finally:
        stop_all(started, grace_seconds)


# --- ports ------------------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind `port` now (as servers do, a port in TIME_WAIT is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on `port`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((host, port)) == 0


def wait_ports_free(ports: Iterable[int], timeout_seconds: float = PORT_FREE_SECONDS) -> bool:
    """Wait until every port in `ports` can be bound again; False if one still cannot."""
    deadline = time.monotonic() + timeout_seconds
    pending = list(ports)
    while pending:
        pending = [port for port in pending if not port_is_free(port)]
        if pending and time.monotonic() > deadline:
            return False
        if pending:
            time.sleep(0.05)
    return True


# --- signals ----------------------------------------------------------------------------------
@contextmanager
def signals_handled(handler: SignalHandler) -> Iterator[None]:
    """SIGINT and SIGTERM go to `handler` inside the block; the previous handlers after it."""
    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, before in previous.items():
            signal.signal(s, before)


def _interrupt(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def signals_as_interrupt() -> AbstractContextManager[None]:
    """SIGINT and SIGTERM both raise KeyboardInterrupt, so one cleanup path runs for either
    (SIGINT too, since a shell starts background jobs with it ignored)."""
    return signals_handled(_interrupt)


def signals_ignored() -> AbstractContextManager[None]:
    """While children are being stopped: a second Ctrl-C must not cut that short, or a child in
    its own process group outlives its parent."""
    return signals_handled(signal.SIG_IGN)


def signals_forwarded(children: Sequence[Child]) -> AbstractContextManager[None]:
    """SIGINT/SIGTERM passed on to each running child's PID (a pool's warm shutdown)."""

    def forward(signum: int, _frame: FrameType | None) -> None:
        for child in children:
            if child.running():
                with contextlib.suppress(ProcessLookupError):
                    child.popen.send_signal(signum)

    return signals_handled(forward)
