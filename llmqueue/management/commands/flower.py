"""`manage.py flower`: Flower with every (pool, tier) queue declared, for their lengths."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand
from kombu import Queue

from llmqueue.queueing.routing import all_queues


class Command(BaseCommand):
    help = (
        "Run Flower (Celery's monitor) on the project's Celery app with every (pool, tier) queue "
        "declared. Flower lists the queues live workers report, else only the declared ones: "
        "declared, a tier's backlog shows even while no worker consumes it. Every argument goes "
        "to Flower, e.g. `manage.py flower --port=5555` (`manage.py flower --help`: Flower's)."
    )

    def run_from_argv(self, argv: list[str]) -> None:
        # Flower parses its own options; Django's parser would reject them.
        self.handle(*argv[2:])

    def handle(self, *flower_args: Any, **options: Any) -> None:
        from project.celery import app

        app.conf.task_queues = [Queue(name) for name in all_queues()]
        app.start(["flower", *map(str, flower_args)])
