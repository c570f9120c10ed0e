"""Requests started at delivery: each delivered message's requests run as soon as it is read.

On a saturated engine the hop from a delivered message to its task (Celery's strategy, a task
slot's thread, the tracer) is often what makes a first token come a step later, and on an idle
one it is a third of the time a request spends in the worker. So the worker's delivery hook
starts each request's whole chain at once (claim, engine, record and publish:
workers/execution.py's `start_prompt`); the Celery task then only takes the chain over and
waits for its end, so the message is acked once the outcome is recorded (acks_late). A message
Celery drops instead (revoked, expired) leaves its chains to end by themselves: the claim
decides, as for every delivery, and an overdue request is only claimed, which expires it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Generic, TypeVar

from contract.task import TaskPayload
from workers.engine import Engine, GenerationRequest, GenerationResult, generation_request
from workers.engine_budget import Hold

T = TypeVar("T")
# Start one delivered request's chain: (payload, the queue it came from, its budget hold, which
# the chain releases when it ends) -> the chain's end.
Starter = Callable[[TaskPayload, str, Hold, bool], "Future[T]"]  # ..., redelivered


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


class PreStarts(Generic[T]):
    """The chains started at delivery, until their tasks take them. Thread-safe: started on the
    consumer thread, taken on task threads."""

    def __init__(self, starter: Starter[T]) -> None:
        self._starter = starter
        self._lock = threading.Lock()
        self._started: dict[str, list[Future[T]]] = {}

    def start(self, payload: TaskPayload, lane: str, hold: Hold, redelivered: bool = False) -> None:
        chain = self._starter(payload, lane, hold, redelivered)
        with self._lock:
            self._started.setdefault(payload["request_id"], []).append(chain)

    def take(self, request_id: str) -> Future[T] | None:
        """The oldest chain started for `request_id` and not taken yet, if any."""
        with self._lock:
            waiting = self._started.get(request_id)
            if not waiting:
                return None
            chain = waiting.pop(0)
            if not waiting:
                del self._started[request_id]
            return chain

    def drop(self, request_ids: list[str]) -> list[str]:
        """Forget one chain of each request whose message will not run (its chain ends by
        itself); the ids that had none."""
        return [request_id for request_id in request_ids if self.take(request_id) is None]

    def __len__(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._started.values())
