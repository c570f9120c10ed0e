"""The admin is styled under the production server: collectstatic, then granian serves the files."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_readme_production_commands_serve_the_admin_stylesheet(
    production_server: str, tmp_path: Path
):
    login = httpx.get(f"{production_server}/admin/login/", timeout=10).text
    assert "/static/admin/css/base.css" in login
    css = httpx.get(f"{production_server}/static/admin/css/base.css", timeout=10)
    assert css.status_code == 200
    assert css.headers["content-type"].startswith("text/css")
    assert css.text == (tmp_path / "static/admin/css/base.css").read_text()
