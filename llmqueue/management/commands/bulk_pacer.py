"""`python manage.py bulk_pacer`: release held bulk lines as quotas allow, finish jobs, and
republish queued requests whose messages the broker lost."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand

from llmqueue.bulk.pacer import run_pacer


class Command(BaseCommand):
    help = (
        "Run the bulk pacer: releases batches' held lines into the broker as tenants' tokens "
        "per minute and tiers' queue depth allow, and finishes jobs. Run one or more next to "
        "the API servers; a Redis lease lets exactly one release at a time. The lease holder "
        "also republishes queued requests whose messages Redis lost (the reconciler)."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        run_pacer(stop)
