"""Requests handed to the engine at delivery, before Celery's task for them runs.

On a saturated engine the hop from a delivered message to its task (Celery's strategy, a task
slot's thread, the tracer) is often what makes a first token come a step later. So the worker's
delivery hook hands each request to the engine at once; the task then takes that generation over
(llmqueue/execution.py), or aborts it when its claim loses. A revoked or expired message drops
its generations (llmqueue/tasks.py). A request already past its deadline is not started.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass

from llmqueue.payload import TaskPayload
from workers.engine import Engine, GenerationRequest, GenerationResult, generation_request


@dataclass(frozen=True)
class Started:
    """One delivery's generation: its id in the engine, its future, when the engine got it."""

    engine_id: str
    future: Future[GenerationResult]
    submitted_at: float


def delivery_request(payload: TaskPayload, lane: str = "") -> GenerationRequest:
    """The engine request of one delivery (from queue `lane`); its id is unique per delivery,
    since a redelivered duplicate may be in the engine at the same time."""
    return generation_request(
        f"{payload['request_id']}:{uuid.uuid4().hex[:12]}",
        payload["prompt"],
        payload["messages"],
        payload["params"],
        payload["priority"],
        lane,
    )


def start_generation(engine: Engine, payload: TaskPayload, lane: str = "") -> Started:
    """Hand one delivery's request to the engine."""
    request = delivery_request(payload, lane)
    submitted_at = time.time()
    return Started(request.request_id, engine.submit(request), submitted_at)


def start_unless_overdue(engine: Engine, payload: TaskPayload, lane: str = "") -> Started | None:
    """`start_generation`, unless the request's deadline passed: then only its claim may run,
    which expires it, and nothing of it is generated."""
    if payload["deadline_ts"] <= time.time():
        return None
    return start_generation(engine, payload, lane)


class PreStarts:
    """Thread-safe: started on the consumer thread, taken on task threads."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._started: dict[str, list[Started]] = {}

    def start(self, payload: TaskPayload, lane: str = "") -> None:
        started = start_unless_overdue(self._engine, payload, lane)
        if started is None:
            return
        with self._lock:
            self._started.setdefault(payload["request_id"], []).append(started)

    def take(self, request_id: str) -> Started | None:
        """The oldest generation started for `request_id` and not taken yet, if any."""
        with self._lock:
            waiting = self._started.get(request_id)
            if not waiting:
                return None
            started = waiting.pop(0)
            if not waiting:
                del self._started[request_id]
            return started

    def drop(self, request_ids: list[str]) -> None:
        """Abort one started generation of each request (its message will not run)."""
        for request_id in request_ids:
            started = self.take(request_id)
            if started is not None:
                self._engine.abort(started.engine_id)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._started.values())
