"""The two programs load only their own side: the API's URL conf no worker module, the worker's
bootstrap no module of the HTTP layer (import-linter checks the imports; this checks a process)."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, subprocess_env

LOADED = "import json, sys; print(json.dumps(sorted(sys.modules)))"


def modules_after(code: str) -> list[str]:
    """The modules a fresh interpreter holds after running `code` (Django set up first)."""
    script = f"import django; django.setup(); {code}; {LOADED}"
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def test_the_api_url_conf_loads_no_worker_module():
    loaded = modules_after("import project.urls, project.wsgi; project.wsgi.application")
    assert "llmqueue.api.views" in loaded  # the probe did load the API
    assert [m for m in loaded if m == "workers" or m.startswith("workers.")] == []


def test_the_worker_bootstrap_loads_no_view_auth_or_validation_module():
    loaded = modules_after("import workers.serve, workers.tasks, workers.runtime")
    assert "workers.execution" in loaded  # the probe did load the worker
    assert [m for m in loaded if m == "llmqueue.api" or m.startswith("llmqueue.api.")] == []
    assert "llmqueue.admission.request" not in loaded
    assert "llmqueue.queueing.submission" not in loaded
