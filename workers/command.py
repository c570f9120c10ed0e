"""The one builder of a worker's command line: `python -m workers.serve` with the given options."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from workers.engines import EngineOptions
from workers.options import SlotOptions, engine_argv, slot_argv

SERVE_MODULE = "workers.serve"


def worker_argv(
    engine: EngineOptions | None = None,
    slots: SlotOptions | None = None,
    queues: Sequence[str] = (),
    node: str = "",
    extra: Sequence[str] = (),
) -> list[str]:
    """`[python, -m, workers.serve, flags...]`; options left None or empty take the worker's own
    defaults (no `queues`: the pool's, read from the database by the worker), and `extra` comes
    last, so its flags win over the ones before."""
    argv = [sys.executable, "-m", SERVE_MODULE]
    if engine is not None:
        argv += engine_argv(engine)
    if slots is not None:
        argv += slot_argv(slots)
    if queues:
        argv += ["--queues", ",".join(queues)]
    if node:
        argv += ["--node-name", node]
    return [*argv, *extra]
