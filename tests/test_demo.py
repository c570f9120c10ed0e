"""`manage.py demo` end to end, run as a user runs it: fresh DB, its own embedded Redis, exit 0."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from llmqueue.demo import PROMPT_COUNT, signals_as_interrupt, signals_ignored
from tests.conftest import free_port

REPO = Path(__file__).resolve().parent.parent


def listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.vllm
@pytest.mark.timeout(480)
def test_demo_serves_every_prompt_and_stops_what_it_started(tmp_path: Path) -> None:
    redis_port, web_port = free_port(), free_port()
    assert not listening(redis_port)
    # The user's environment, minus what the test settings injected into this process.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMQUEUE_")}
    env |= {
        "DJANGO_SETTINGS_MODULE": "project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'demo.sqlite3'}",
        "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "DEMO_PORT": str(web_port),
        "DEMO_EXIT": "1",
    }
    redis_dir = Path(settings.STATE_DIR) / "redis" / str(redis_port)
    try:
        done = subprocess.run(
            [sys.executable, "manage.py", "demo"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
        )
    finally:
        shutil.rmtree(redis_dir, ignore_errors=True)

    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert f"started an embedded Redis at redis://127.0.0.1:{redis_port}/0" in done.stdout
    assert f"{PROMPT_COUNT}/{PROMPT_COUNT} prompts succeeded" in done.stdout, output
    assert f"http://127.0.0.1:{web_port}/admin/" in done.stdout
    assert not listening(redis_port)
    assert not listening(web_port)


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
