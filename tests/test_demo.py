"""`python -m devtools.demo` end to end as a user runs it: fresh DB, own embedded Redis, exit 0."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from devtools.demo import PROMPT_COUNT
from workers.processes import free_port, listening

REPO = Path(__file__).resolve().parent.parent


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
            [sys.executable, "-m", "devtools.demo"],
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
