"""The engine watchdog: a worker whose engine stopped stepping hands its requests back and exits.

A hung engine (a CUDA hang, a deadlocked step, an engine thread that died) would leave the worker
beating and fetching while nothing it holds can finish: its requests would wait for the hour of
the visibility timeout, and new ones would keep arriving. Every beat interval the watchdog looks
at the engine's step count; when requests are in the engine and no step ended for
LLMQUEUE_ENGINE_STALL_SECONDS, it stops fetching, waits out a BRPOP in flight, puts every
message the worker holds back at the head of its queue (celery_ext/rescue.py) and exits with
ENGINE_STALLED, for the process supervisor to start a fresh worker. It does not leave the pool's
live workers: its beat goes stale, so a message delivered after the hand-back all the same is
rescued by another worker like a dead one's. The requests' rows stay `running`, so the claim
that takes each over counts this worker as lost (llmqueue/lifecycle.py): a request that hangs
every engine it reaches is failed after LLMQUEUE_MAX_WORKER_LOSSES of them, like one that kills
them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ENGINE_STALLED = 4  # the worker's exit status when its watchdog found the engine hung
# kombu's BRPOP times out after 1 s: one in flight when fetching stops has returned by then.
IN_FLIGHT_FETCH_SECONDS = 1.5


@dataclass
class StepWatch:
    """When the engine last made progress, as the watchdog saw it."""

    stall_seconds: float
    steps: int = -1
    since: float = 0.0

    def stalled(self, steps: int, in_engine: int, now: float) -> float | None:
        """Seconds without a step while requests were in the engine, once past `stall_seconds`
        (else None). An idle engine makes no steps and is not stalled."""
        if steps != self.steps or in_engine == 0:
            self.steps, self.since = steps, now
            return None
        quiet = now - self.since
        return quiet if quiet >= self.stall_seconds else None


class Watchdog:
    """The periodic check (workers/periodic.py runs it): `stats()` is the engine's counters,
    `stop_fetching()` closes the worker's intake, `hand_back()` restores its held messages."""

    def __init__(
        self,
        watch: StepWatch,
        stats: Callable[[], dict[str, Any]],
        stop_fetching: Callable[[], None],
        hand_back: Callable[[], int],
        clock: Callable[[], float],
        exit_process: Callable[[int], object] = os._exit,
        sleep: Callable[[float], object] = time.sleep,
    ) -> None:
        self.watch, self.stats, self.clock = watch, stats, clock
        self.stop_fetching, self.hand_back = stop_fetching, hand_back
        self.exit_process, self.sleep = exit_process, sleep

    def __call__(self) -> None:
        stats = self.stats()
        quiet = self.watch.stalled(int(stats["steps"]), int(stats["in_engine"]), self.clock())
        if quiet is None:
            return
        log.error(
            "engine made no step for %.0f s with %d requests in it: handing every held message "
            "back to its queue and exiting (status %d)",
            quiet,
            stats["in_engine"],
            ENGINE_STALLED,
        )
        try:
            self.stop_fetching()
            self.sleep(IN_FLIGHT_FETCH_SECONDS)
            restored = self.hand_back()
            log.error("%d held messages requeued", restored)
        finally:
            # Not sys.exit: Celery's warm shutdown would wait on the hung engine's requests.
            self.exit_process(ENGINE_STALLED)
