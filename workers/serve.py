"""Worker bootstrap: build the warm engine once, then run a Celery threads-pool worker around it.

Run by `manage.py runworkers` (one process per GPU), or directly:
    python -m workers.serve --engine vllm --model PATH --pool default --queues default.interactive
The worker takes its tier queues in the order of `--dispatch` (fifo, strict, ours: see
workers/dispatch.py) and holds at most its engine budget (workers/engine_budget.py).
A worker whose engine cannot load exits with status 3 and a one-line reason, before it consumes.
`--step-log PATH` (off by default) appends each engine step's start and end time to PATH, for
benchmarks, then its requests (running, joined, finished), the loop thread's CPU ms and the
requests parked outside the engine.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from workers.batching import ContinuousEngine
from workers.dispatch import DispatchMode
from workers.engine import Engine
from workers.engines import build_engine
from workers.options import (
    add_engine_arguments,
    add_slot_arguments,
    bulk_reserve,
    engine_options,
    joins_per_step,
    slot_options,
    task_slots,
)
from workers.served_models import served_model_names

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


def warn_fifo_over_queues(mode: DispatchMode, queues: list[str]) -> None:
    if mode is DispatchMode.FIFO and len(queues) > 1:
        print(
            f"llmqueue worker: --dispatch fifo over {len(queues)} queues takes them in turn "
            "(kombu's round robin); set LLMQUEUE_SHARED_QUEUE=true on API and workers for one "
            "arrival order",
            file=sys.stderr,
        )


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
    from llmqueue.queueing.lanes import pool_queues
    from project.celery import app
    from workers import runtime
    from workers.tasks import serve_with

    node = args.node_name or f"{slot_opts.pool}@{socket.gethostname()}"
    given = [q for q in args.queues.split(",") if q]
    queues = given or pool_queues(slot_opts.pool)
    if not queues:
        print(f"llmqueue worker {node}: no queues (no tiers defined?)", file=sys.stderr)
        return 2
    try:
        engine = build_engine(engine_opts)
    except Exception as exc:
        print(
            f"llmqueue worker {node}: cannot load the {engine_opts.kind} engine for model "
            f"{engine_opts.model!r}: {type(exc).__name__}: {exc}. Not consuming any queue.",
            file=sys.stderr,
        )
        return ENGINE_LOAD_FAILED
    if args.step_log:
        log_engine_steps(engine, args.step_log)
    slots = task_slots(slot_opts.slots, engine_opts.max_num_seqs)
    reserve = bulk_reserve(slot_opts.bulk_reserve, engine_opts.max_num_seqs, slot_opts.dispatch)
    mode = DispatchMode(slot_opts.dispatch)
    joins = joins_per_step(slot_opts.bulk_joins_per_step, engine_opts.max_num_seqs)
    dispatcher = runtime.build_dispatcher(
        mode, engine_opts.max_num_seqs, slots, slot_opts.token_budget, reserve, joins
    )
    # --queues: exactly those, as told; else the pool's tier queues as tiers come and go.
    info = {"engine": engine_opts.kind, "model": engine_opts.model}
    served = served_model_names(engine_opts.served_model_name, engine.model_name)
    worker = runtime.build_runtime(
        node, slot_opts.pool, engine, dispatcher, queues, not given, served, info
    )
    runtime.requeue_predecessors_messages(node)
    serve_with(worker)
    runtime.attach(worker)
    warn_fifo_over_queues(mode, queues)
    threads = slots + reserve
    app.worker_main(celery_argv(queues, threads, node, slot_opts.loglevel, slot_opts.events))
    return 0


if __name__ == "__main__":
    sys.exit(main())
