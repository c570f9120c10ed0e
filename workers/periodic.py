"""A daemon thread that runs one job every few seconds until stopped (tier settings, sweeps)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class Periodic:
    def __init__(self, name: str, interval_seconds: float, job: Callable[[], object]) -> None:
        self.name, self.interval_seconds, self.job = name, interval_seconds, job
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"llmqueue-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.job()
            except Exception:  # the next run may succeed (DB or Redis back)
                log.exception("%s failed; retrying in %.1f s", self.name, self.interval_seconds)
            self._stop.wait(self.interval_seconds)
