"""The admin and its dashboard in a real browser (Debian's chromium driven by Playwright), served
by the README's production commands: collectstatic, then granian."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import redis
from django.contrib.auth import get_user_model

from llmqueue.api.auth import caller_for_key
from llmqueue.api.validation import PromptSpec
from llmqueue.queueing.routing import resolve_model
from llmqueue.queueing.submission import submit_prompts
from tests.conftest import REPO, Seeded, pretend_live
from workers.depth_history import record_depths

pytestmark = pytest.mark.django_db(transaction=True)
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Screenshots stay here after the run (CI keeps the checkout): open them to see what was tested.
ARTIFACTS = Path(os.environ.get("LLMQUEUE_TEST_ARTIFACTS", REPO / ".llmqueue" / "test-artifacts"))


def test_the_styled_admin_and_the_dashboard_show_a_known_backlog(
    seeded: Seeded, clean_redis: redis.Redis, production_server: str
):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: .ci/run installs Debian's chromium")
        pytest.skip("no chromium here (apt-get install chromium); CI runs this test")
    from playwright.sync_api import sync_playwright

    get_user_model().objects.create_superuser("ops", "ops@example.com", "a long pass phrase")
    pretend_live(clean_redis, "default")
    caller, route = caller_for_key(seeded.key), resolve_model("sim")
    spec = PromptSpec("completion", "sim", "hi", None, {"max_tokens": 2}, 1, background=True)
    submit_prompts(caller, route, [spec] * 3)  # nobody consumes: a backlog of exactly 3
    record_depths(clean_redis, ["default.interactive"])

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.goto(f"{production_server}/admin/login/")
            page.fill("#id_username", "ops")
            page.fill("#id_password", "a long pass phrase")
            page.click("input[type=submit]")
            page.wait_for_selector("#queue-dashboard")
            styled = page.evaluate(
                "() => [...document.styleSheets].some(s => s.href"
                " && s.href.endsWith('/static/admin/css/base.css') && s.cssRules.length > 0)"
            )
            assert styled, "the admin's stylesheet did not load"
            page.click("#queue-dashboard")
            row = 'tr[data-queue="default.interactive"]'
            page.wait_for_selector(row)
            assert page.inner_text(f"{row} td.waiting") == "3"
            assert page.inner_text(f"{row} td.unacked") == "0"
            assert page.inner_text('tr[data-queue="default.batch"] td.waiting') == "0"
            assert page.locator('polyline[data-series="default.interactive"]').count() == 1
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
