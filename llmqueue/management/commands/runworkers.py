"""`manage.py runworkers`: execs the worker pool, `python -m workers.pool`, with the same args."""

from __future__ import annotations

import os
import sys
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand

POOL_MODULE = "workers.pool"


def pool_argv(args: list[str]) -> list[str]:
    return [sys.executable, "-m", POOL_MODULE, *args]


def pool_env() -> dict[str, str]:
    """Ours, with the project on the path: `-m` finds `workers` from any working directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(settings.BASE_DIR), env.get("PYTHONPATH", "")) if p
    )
    return env


class Command(BaseCommand):
    help = (
        "Start one Celery worker process per GPU (CUDA_VISIBLE_DEVICES pinned), each with one warm "
        "engine fed by many task slots; `manage.py runworkers --help`: the pool's options. The "
        "API side imports no worker code: this execs `python -m workers.pool` with every argument."
    )

    def run_from_argv(self, argv: list[str]) -> None:
        # The pool parses its own options (--help included); Django's parser would reject them.
        self.handle(*argv[2:])

    def handle(self, *args: Any, **options: Any) -> None:
        argv = pool_argv([str(a) for a in args])
        os.execve(argv[0], argv, pool_env())
