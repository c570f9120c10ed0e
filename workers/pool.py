"""A GPU host's pool: one `workers.serve` process per GPU, pinned by CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import dataclass

from workers import processes
from workers.command import worker_argv
from workers.engines import EngineOptions
from workers.options import (
    SlotOptions,
    add_engine_arguments,
    add_slot_arguments,
    engine_options,
    slot_options,
)


@dataclass(frozen=True)
class WorkerProcess:
    argv: list[str]
    env: dict[str, str]
    node: str


def worker_processes(
    gpus: list[str], cpu_workers: int, queues: list[str], engine: EngineOptions, slots: SlotOptions
) -> list[WorkerProcess]:
    """The processes to start: one per GPU id, or `cpu_workers` unpinned ones without GPUs.
    No `queues`: each worker consumes its pool's, as the database lists them when it starts."""
    host = socket.gethostname()
    devices: list[str | None] = list(gpus) if gpus else [None] * cpu_workers
    planned = []
    for index, device in enumerate(devices):
        env = dict(os.environ)
        if device is not None:
            # Pinned before torch is imported in the child: the engine sees exactly one GPU.
            env["CUDA_VISIBLE_DEVICES"] = device
            node = f"{slots.pool}-gpu{device}@{host}"
        else:
            node = f"{slots.pool}-cpu{index}@{host}"
        planned.append(WorkerProcess(worker_argv(engine, slots, queues, node), env, node))
    return planned


def run_pool(planned: list[WorkerProcess]) -> int:
    """Start every process, pass SIGINT/SIGTERM on to them, wait for all; the worst exit status.

    Each worker leads its own process group: a terminal's Ctrl-C reaches only the pool, which
    passes it on once (a second SIGINT would turn Celery's warm shutdown into a cold one)."""
    children: list[processes.Child] = []
    with processes.signals_forwarded(children):
        for process in planned:
            children.append(
                processes.start(process.node, process.argv, env=process.env, inherit_output=True)
            )
        codes = [child.popen.wait() for child in children]
    for process, code in zip(planned, codes, strict=True):
        if code:
            print(f"worker {process.node} exited with status {code}", file=sys.stderr)
    return max(codes, default=0)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="manage.py runworkers",
        description="Start one Celery worker process per GPU (CUDA_VISIBLE_DEVICES pinned), each "
        "with one warm engine fed by many task slots. Without --gpus, start --cpu-workers "
        "unpinned workers (vLLM's CPU build with --in-process, or --engine simulated).",
    )
    parser.add_argument("--gpus", default="", help="comma-separated GPU ids, e.g. 0,1")
    parser.add_argument("--cpu-workers", type=int, default=1, help="workers when no --gpus")
    add_engine_arguments(parser)
    add_slot_arguments(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    engine, slots = engine_options(args), slot_options(args)
    if engine.kind == "vllm" and not engine.model:
        print("runworkers: --model is required for the vllm engine", file=sys.stderr)
        return 2
    gpus = [g.strip() for g in args.gpus.split(",") if g.strip()]
    planned = worker_processes(gpus, args.cpu_workers, [], engine, slots)
    for process in planned:
        print(f"starting {process.node} on pool {slots.pool!r}'s queues", flush=True)
    return run_pool(planned)


if __name__ == "__main__":
    sys.exit(main())
