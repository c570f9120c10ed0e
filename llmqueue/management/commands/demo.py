"""`manage.py demo`: the whole stack locally, a burst of prompts, then serving (llmqueue.demo)."""

from __future__ import annotations

import os
import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from llmqueue.demo import DemoError, run_demo


class Command(BaseCommand):
    help = (
        "Migrate, start Redis if none answers (embedded, AOF under .llmqueue/), build a tiny "
        "model, start a vLLM CPU worker and the web server, send a burst of prompts through the "
        "API, then serve until Ctrl-C. Env: DEMO_PORT (default 8000), DEMO_EXIT=1 to stop after "
        "the burst."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        port = int(os.environ.get("DEMO_PORT", "8000"))
        exit_after = os.environ.get("DEMO_EXIT", "").strip().lower() in {"1", "true", "yes"}
        try:
            run_demo(port, exit_after)
        except DemoError as exc:
            raise CommandError(str(exc)) from exc
        except KeyboardInterrupt:
            self.stderr.write("interrupted")
            sys.exit(130)
