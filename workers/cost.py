"""What a worker spends per request, counted where it is spent: DB statements, CPU, its threads.

Benchmarks turn these into per-request figures (bench/throughput.py), so a regression in the
queue's own cost shows as a number. The heartbeat publishes a snapshot with every beat
(contract.liveness.worker_stats); counting a statement is one Python call, nothing is timed.
"""

from __future__ import annotations

import threading
import time
from typing import Any

_statements = [0]  # one list cell: += under the GIL from the recorder's thread only


def _count_statement(execute: Any, sql: Any, params: Any, many: bool, context: Any) -> Any:
    _statements[0] += 1
    return execute(sql, params, many, context)


def count_db_statements() -> None:
    """Count every statement this process's Django connections execute from now on (each
    `executemany` counts once: one round trip)."""
    from django.db.backends.signals import connection_created

    def on_connection(sender: Any, connection: Any, **_: Any) -> None:
        if _count_statement not in connection.execute_wrappers:
            connection.execute_wrappers.append(_count_statement)

    connection_created.connect(on_connection, weak=False)


def db_statements() -> int:
    return _statements[0]


def thread_names() -> dict[int, str]:
    """OS thread id → the Python thread's name, task slots under one name (CPU per thread is
    read from /proc by whoever wants it; threads missing here are native: OpenMP, vLLM's)."""
    names = {}
    for thread in threading.enumerate():
        if thread.native_id is None:
            continue
        name = thread.name
        if name.startswith("ThreadPoolExecutor-"):  # Celery's threads pool: one per task slot
            name = "task-slots"
        names[thread.native_id] = name
    return names


def snapshot(engine_stats: dict[str, Any]) -> dict[str, Any]:
    """The worker's counters now, as the heartbeat publishes them; its CPU includes an engine
    process's (workers/engine_process.py)."""
    return {
        "at": time.time(),
        "cpu_seconds": time.process_time() + engine_stats.get("process_cpu_seconds", 0.0),
        "db_statements": db_statements(),
        "engine": engine_stats,
        "threads": {str(tid): name for tid, name in thread_names().items()},
    }
