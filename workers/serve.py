"""Worker bootstrap: build the warm engine once, then run a Celery threads-pool worker around it.

Run by `manage.py runworkers` (one process per GPU), or directly:
    python -m workers.serve --engine vllm --model PATH --pool default --queues default.interactive
The worker takes its tier queues in the order of `--dispatch` (fifo, strict, ours: see
workers/dispatch.py) and holds at most its engine budget (workers/engine_budget.py).
A worker whose engine cannot load exits with status 3 and a one-line reason, before it consumes.
`--step-log PATH` (off by default) appends each engine step's start and end time to PATH, for
benchmarks.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from functools import partial
from typing import Any

from workers import runtime
from workers.batching import ContinuousEngine
from workers.dispatch import DispatchMode
from workers.engine import Engine
from workers.options import (
    add_engine_arguments,
    add_slot_arguments,
    engine_options,
    slot_options,
    task_slots,
)

ENGINE_LOAD_FAILED = 3


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.serve", description=__doc__)
    add_engine_arguments(parser)
    add_slot_arguments(parser)
    parser.add_argument(
        "--queues",
        default="",
        help="comma-separated queues (default: every tier queue of the pool, followed as tiers are "
        "added or deleted in the admin)",
    )
    parser.add_argument("--node-name", default="", help="Celery node name (default pool@host)")
    parser.add_argument(
        "--step-log",
        default="",
        metavar="PATH",
        help="append each engine step's number, start and end time (epoch seconds) to PATH, one "
        "line per step, for benchmarks that count steps (bench/headroom.py); default: off",
    )
    return parser.parse_args(argv)


def celery_argv(queues: list[str], slots: int, node: str, loglevel: str, events: bool) -> list[str]:
    argv = [
        "worker",
        "--pool=threads",
        f"--concurrency={slots}",
        "--queues",
        ",".join(queues),
        "--hostname",
        node,
        # Gossip and mingle cost every worker CPU per peer and add nothing to this design.
        "--without-gossip",
        "--without-mingle",
        f"--loglevel={loglevel}",
    ]
    return argv + (["--task-events"] if events else [])


def _start_heartbeat(pool: str, node: str) -> None:
    from celery.signals import worker_ready, worker_shutdown
    from django.conf import settings

    from llmqueue.redis_client import get_redis
    from workers import cost
    from workers.heartbeat import Heartbeat

    engine = runtime.current_engine()
    cost.count_db_statements()
    beat = Heartbeat(
        get_redis(),
        pool,
        node,
        settings.LLMQUEUE_WORKER_HEARTBEAT_SECONDS,
        stats=lambda: cost.snapshot(engine.stats()),
    )

    # Beat only once the consumer runs: /v1/models must not list a pool nobody consumes yet.
    @worker_ready.connect(weak=False)
    def _ready(**_: Any) -> None:
        beat.start()

    @worker_shutdown.connect(weak=False)
    def _shutdown(**_: Any) -> None:
        beat.stop()


def _start_dispatcher(
    mode: DispatchMode,
    max_num_seqs: int,
    slots: int,
    token_budget: int,
    queues: list[str],
    node: str,
    follow_pool: str = "",
) -> None:
    """Install this process's dispatcher (workers/queue_order.py) with the tiers as they are now,
    and the threads that keep it current: tier settings re-read (and, with `follow_pool`, that
    pool's tier queues consumed as tiers come and go), overdue requests swept. It starts each
    delivered request's chain, claiming it as node `node`."""
    from celery.signals import worker_ready, worker_shutdown
    from django.conf import settings

    from workers import queue_order
    from workers.engine_budget import EngineLimits, default_token_budget
    from workers.execution import start_delivered
    from workers.periodic import Periodic
    from workers.prestart import PreStarts
    from workers.recorder import get_recorder
    from workers.tier_settings import QueueFollower, load_tier_policies

    budget = token_budget or default_token_budget(
        max_num_seqs, settings.LLMQUEUE_TYPICAL_REQUEST_TOKENS
    )
    dispatcher = queue_order.Dispatcher(
        mode,
        EngineLimits(max_num_seqs, slots, budget),
        settings.LLMQUEUE_BYTES_PER_TOKEN,
        settings.LLMQUEUE_HEADROOM_WINDOW_SECONDS,
    )
    dispatcher.set_tiers(load_tier_policies())
    engine = runtime.current_engine()
    dispatcher.prestarts = PreStarts(partial(start_delivered, node, get_recorder(), engine))
    if isinstance(engine, ContinuousEngine):
        engine.admission = dispatcher.may_start
    queue_order.install(dispatcher)
    if mode is DispatchMode.FIFO and len(queues) > 1:
        print(
            f"llmqueue worker: --dispatch fifo over {len(queues)} queues takes them in turn "
            "(kombu's round robin); set LLMQUEUE_SHARED_QUEUE=true on API and workers for one "
            "arrival order",
            file=sys.stderr,
        )
    follower = QueueFollower(follow_pool, queues)

    def refresh_tiers() -> None:
        dispatcher.set_tiers(load_tier_policies())  # before a new tier's queue is consumed
        if follow_pool:
            follower.refresh()

    jobs = [Periodic("tier-settings", settings.LLMQUEUE_TIER_REFRESH_SECONDS, refresh_tiers)]
    if mode is DispatchMode.OURS:
        sweep_seconds = settings.LLMQUEUE_DEADLINE_SWEEP_SECONDS
        # Waits for each sweep, so a slow one delays the next instead of piling up behind it.
        jobs.append(
            Periodic("deadline-sweep", sweep_seconds, lambda: get_recorder().sweep().result())
        )

    @worker_ready.connect(weak=False)
    def _ready(sender: Any = None, **_: Any) -> None:
        follower.consumer = sender  # Celery's Consumer
        for job in jobs:
            job.start()

    @worker_shutdown.connect(weak=False)
    def _shutdown(**_: Any) -> None:
        for job in jobs:
            job.stop()


def log_engine_steps(engine: Engine, path: str) -> None:
    """--step-log: both engine adapters run the continuous-batching loop, which keeps the log."""
    if not isinstance(engine, ContinuousEngine):
        raise TypeError(f"{type(engine).__name__} has no engine loop to log the steps of")
    engine.log_steps(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    engine_opts, slot_opts = engine_options(args), slot_options(args)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "project.settings")
    import django

    django.setup()
    import workers.tasks  # noqa: F401  (registers the generate task with the app)
    from llmqueue.queueing.lanes import pool_queues
    from project.celery import app

    node = args.node_name or f"{slot_opts.pool}@{socket.gethostname()}"
    given = [q for q in args.queues.split(",") if q]
    queues = given or pool_queues(slot_opts.pool)
    if not queues:
        print(f"llmqueue worker {node}: no queues (no tiers defined?)", file=sys.stderr)
        return 2
    try:
        engine = runtime.build_engine(engine_opts)
    except Exception as exc:
        print(
            f"llmqueue worker {node}: cannot load the {engine_opts.kind} engine for model "
            f"{engine_opts.model!r}: {type(exc).__name__}: {exc}. Not consuming any queue.",
            file=sys.stderr,
        )
        return ENGINE_LOAD_FAILED
    if args.step_log:
        log_engine_steps(engine, args.step_log)
    runtime.install(engine)
    slots = task_slots(slot_opts.slots, engine_opts.max_num_seqs)
    _start_dispatcher(
        DispatchMode(slot_opts.dispatch),
        engine_opts.max_num_seqs,
        slots,
        slot_opts.token_budget,
        queues,
        node,
        follow_pool="" if given else slot_opts.pool,  # --queues: exactly those, as told
    )
    _start_heartbeat(slot_opts.pool, node)
    app.worker_main(celery_argv(queues, slots, node, slot_opts.loglevel, slot_opts.events))
    return 0


if __name__ == "__main__":
    sys.exit(main())
