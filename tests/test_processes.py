"""The one process supervisor: stop by PID and process group, ports freed, signals handled."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from workers import processes
from workers.processes import signals_as_interrupt, signals_ignored

# A child that starts a grandchild, writes its PID, and ignores SIGTERM: only SIGKILL stops it.
STUBBORN = """
import signal, subprocess, sys, time
grandchild = subprocess.Popen(["sleep", "120"])
open(sys.argv[1], "w").write(str(grandchild.pid))
signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    """Running, not merely a zombie waiting to be reaped."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_child_that_ignores_sigterm_is_killed_with_what_it_started(tmp_path: Path):
    pid_file = tmp_path / "grandchild.pid"
    child = processes.start("stubborn", [sys.executable, "-c", STUBBORN, str(pid_file)])
    assert wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
    grandchild = int(pid_file.read_text())
    killed: list[str] = []

    code = processes.stop(child, grace_seconds=0.5, on_kill=lambda c: killed.append(c.name))

    assert code == -signal.SIGKILL
    assert killed == ["stubborn"]
    assert wait_for(lambda: not alive(grandchild))


def test_a_warm_stop_is_not_a_kill(tmp_path: Path):
    child = processes.start("sleeper", ["sleep", "60"], log_path=tmp_path / "sleeper.log")
    killed: list[str] = []
    assert processes.stop(child, on_kill=lambda c: killed.append(c.name)) == -signal.SIGTERM
    assert killed == []


def test_a_stopped_server_frees_its_port():
    port = processes.free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    with processes.supervised() as started:
        server = processes.start("http", argv, ports=(port,))
        started.append(server)
        assert wait_for(lambda: processes.listening(port))
    assert not server.running()
    assert processes.port_is_free(port)
    assert not processes.listening(port)


def test_stop_signals_are_passed_on_to_each_running_child():
    children = [processes.start(f"sleeper{i}", ["sleep", "60"]) for i in range(2)]
    try:
        with processes.signals_forwarded(children):
            signal.raise_signal(signal.SIGTERM)
        assert [c.popen.wait(timeout=10) for c in children] == [-signal.SIGTERM] * 2
    finally:
        processes.stop_all(children)


def test_a_second_stop_signal_does_not_cut_the_cleanup_short() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with signals_as_interrupt():
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
        with signals_ignored():  # what the demo holds while it stops its children
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is signal.getsignal(signal.SIGTERM)  # raising again
    assert signal.getsignal(signal.SIGTERM) is before
