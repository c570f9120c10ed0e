"""A worker's single DB thread: task slots hand it claims and outcomes, it writes them in batches.

A GPU worker runs ~100+ task slots; one DB connection each would exhaust PostgreSQL's
max_connections and contend on SQLite's lock. One thread with one connection takes whatever
accumulated while its last batch ran, so a lone request waits for nothing and a burst costs a
few statements instead of hundreds.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from django.db import close_old_connections, connection
from django.utils import timezone

from llmqueue import lifecycle

log = logging.getLogger(__name__)

_Job = tuple[str, Any, Future[Any]]


class Recorder:
    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="llmqueue-recorder", daemon=True)
        self._thread.start()

    def claim(self, request_id: uuid.UUID, worker: str) -> lifecycle.Claim:
        return self._call("claim", (request_id, worker))

    def finish(self, outcome: lifecycle.Finish) -> bool:
        return self._call("finish", outcome)

    def _call(self, op: str, item: Any) -> Any:
        future: Future[Any] = Future()
        self._jobs.put((op, item, future))
        return future.result()

    def _run(self) -> None:
        while True:
            jobs = [self._jobs.get()]
            while True:
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            for op, handler in (("claim", self._claims), ("finish", self._finishes)):
                batch = [j for j in jobs if j[0] == op]
                if batch:
                    self._apply(batch, handler)

    def _apply(self, batch: list[_Job], handler: Callable[[list[_Job]], None]) -> None:
        close_old_connections()
        try:
            handler(batch)
        except Exception as exc:
            log.exception("recording %d %s jobs failed", len(batch), batch[0][0])
            connection.close()  # a broken connection must not poison the next batch
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)

    @staticmethod
    def _claims(batch: list[_Job]) -> None:
        by_worker: dict[str, list[_Job]] = {}
        for job in batch:
            by_worker.setdefault(job[1][1], []).append(job)
        for worker, jobs in by_worker.items():
            ids = list(dict.fromkeys(j[1][0] for j in jobs))
            claims = lifecycle.claim(ids, worker, timezone.now())
            seen: set[uuid.UUID] = set()
            for _, (request_id, _), future in jobs:
                # The same id twice in one batch: a duplicate delivery; only one may run it.
                outcome = claims[request_id]
                if request_id in seen:
                    outcome = lifecycle.Claim(request_id, None)
                seen.add(request_id)
                future.set_result(outcome)

    @staticmethod
    def _finishes(batch: list[_Job]) -> None:
        won = lifecycle.finish([j[1] for j in batch], timezone.now())
        for _, outcome, future in batch:
            future.set_result(outcome.request_id in won)


_recorder: Recorder | None = None
_lock = threading.Lock()


def get_recorder() -> Recorder:
    global _recorder
    with _lock:
        if _recorder is None:
            _recorder = Recorder()
        return _recorder
