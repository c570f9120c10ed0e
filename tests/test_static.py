"""The admin is styled under the production server: collectstatic, then granian serves the files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, subprocess_env, wait_until
from workers import processes
from workers.processes import free_port

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_readme_production_commands_serve_the_admin_stylesheet(tmp_path: Path):
    env = {**subprocess_env(), "STATIC_ROOT": str(tmp_path / "static")}
    manage = [sys.executable, "manage.py", "collectstatic", "--noinput"]
    subprocess.run(manage, cwd=REPO, env=env, check=True, capture_output=True, timeout=120)
    port = free_port()
    argv = [
        sys.executable, "-m", "granian", "--interface", "wsgi", "--host", "127.0.0.1",
        "--port", str(port), "--workers", "1", "--blocking-threads", "2", "--no-ws",
        "--log-level", "warning", "project.wsgi:application",
    ]  # fmt: skip
    server = processes.start("api", argv, cwd=REPO, env=env, ports=(port,), inherit_output=True)
    base = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(f"{base}/admin/login/", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, 30, "granian")
        login = httpx.get(f"{base}/admin/login/", timeout=10).text
        assert "/static/admin/css/base.css" in login
        css = httpx.get(f"{base}/static/admin/css/base.css", timeout=10)
        assert css.status_code == 200
        assert css.headers["content-type"].startswith("text/css")
        assert css.text == (tmp_path / "static/admin/css/base.css").read_text()
    finally:
        processes.stop(server)
