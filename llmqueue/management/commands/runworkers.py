"""`manage.py runworkers`: start this host's GPU worker pool, one Celery worker process per GPU."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from llmqueue.queueing.lanes import pool_queues
from workers.options import add_engine_arguments, add_slot_arguments, engine_options, slot_options
from workers.pool import run_pool, worker_processes


class Command(BaseCommand):
    help = (
        "Start one Celery worker process per GPU (CUDA_VISIBLE_DEVICES pinned), each with one warm "
        "engine fed by many task slots. Without --gpus, start --cpu-workers unpinned workers "
        "(vLLM's CPU build with --in-process, or --engine simulated)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--gpus", default="", help="comma-separated GPU ids, e.g. 0,1")
        parser.add_argument("--cpu-workers", type=int, default=1, help="workers when no --gpus")
        add_engine_arguments(parser)
        add_slot_arguments(parser)

    def handle(self, *args: Any, **opts: Any) -> None:
        namespace = type("Args", (), opts)
        engine, slots = engine_options(namespace), slot_options(namespace)  # type: ignore[arg-type]
        if engine.kind == "vllm" and not engine.model:
            raise CommandError("--model is required for the vllm engine")
        queues = pool_queues(slots.pool)
        if not queues:
            raise CommandError("no tiers defined: add one in the admin first")
        gpus = [g.strip() for g in opts["gpus"].split(",") if g.strip()]
        processes = worker_processes(gpus, opts["cpu_workers"], queues, engine, slots)
        for process in processes:
            self.stdout.write(f"starting {process.node} on queues {','.join(queues)}")
        code = run_pool(processes)
        if code:
            sys.exit(code)
