"""A GPU host's pool: one `workers.serve` process per GPU, pinned by CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass

from workers.options import SlotOptions, engine_argv, slot_argv
from workers.runtime import EngineOptions


@dataclass(frozen=True)
class WorkerProcess:
    argv: list[str]
    env: dict[str, str]
    node: str


def worker_processes(
    gpus: list[str], cpu_workers: int, queues: list[str], engine: EngineOptions, slots: SlotOptions
) -> list[WorkerProcess]:
    """The processes to start: one per GPU id, or `cpu_workers` unpinned ones without GPUs."""
    host = socket.gethostname()
    devices: list[str | None] = list(gpus) if gpus else [None] * cpu_workers
    processes = []
    for index, device in enumerate(devices):
        env = dict(os.environ)
        if device is not None:
            # Pinned before torch is imported in the child: the engine sees exactly one GPU.
            env["CUDA_VISIBLE_DEVICES"] = device
            node = f"{slots.pool}-gpu{device}@{host}"
        else:
            node = f"{slots.pool}-cpu{index}@{host}"
        argv = [sys.executable, "-m", "workers.serve", *engine_argv(engine), *slot_argv(slots)]
        argv += ["--queues", ",".join(queues), "--node-name", node]
        processes.append(WorkerProcess(argv, env, node))
    return processes


def run_pool(processes: list[WorkerProcess]) -> int:
    """Start every process, pass SIGINT/SIGTERM on to them, wait for all; the worst exit status."""
    children = [subprocess.Popen(p.argv, env=p.env) for p in processes]

    def forward(signum: int, _frame: object) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        codes = [child.wait() for child in children]
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for process, code in zip(processes, codes, strict=True):
        if code:
            print(f"worker {process.node} exited with status {code}", file=sys.stderr)
    return max(codes, default=0)
