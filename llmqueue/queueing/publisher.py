"""Publishing a generate task: Celery's own task message, queued in one Redis round trip.

The message is built without `apply_async` (celery_ext/message.py says why and what that skips)
and queued with a persistent client: by its deadline (llmqueue/queueing/deadline_order.py:
usually one LPUSH inside a script), or with a plain LPUSH when LLMQUEUE_EDF_WITHIN_TIER is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

import redis
from django.conf import settings

from celery_ext import message
from contract.redis_url import connect
from contract.task import GENERATE_IGNORE_RESULT
from llmqueue.queueing.deadline_order import insert_by_deadline, stamp
from llmqueue.queueing.publishing import clear
from project.celery import app


@cache
def _broker() -> redis.Redis:
    return connect(app.conf.broker_url, settings.REDIS_SENTINEL_MASTER)


def task_envelope(
    task_name: str,
    task_id: str,
    queue: str,
    args: list[Any],
    expires: datetime | None,
    argsrepr: str,
) -> str:
    """The message (celery_ext/message.py) of a generate task, stamped with its deadline."""
    return message.task_envelope(
        app, task_name, task_id, queue, args, expires, argsrepr, GENERATE_IGNORE_RESULT, stamp
    )


@dataclass(frozen=True)
class TaskMessage:
    """One task to publish: Celery's task id, the queue, the task's positional arguments."""

    task_id: str
    queue: str
    args: list[Any]
    expires: datetime | None = None
    argsrepr: str = "()"
    # Due before its tier's deadline: queued ahead of the requests due later. The others keep
    # arrival order (the tier's deadline after their arrival), which one LPUSH gives.
    by_deadline: bool = False
    # Admitted by the API and counted in the queue's depth until queued (publishing.py).
    publishing_ids: tuple[str, ...] = ()


def publish_tasks(task_name: str, messages: list[TaskMessage]) -> None:
    """Put task messages on their queues in one round trip, each queue's in the given order
    (LPUSH several values: a worker's BRPOP takes them oldest first). Raises redis.RedisError
    when the broker refuses them."""
    by_queue: dict[str, list[tuple[datetime | None, str]]] = {}
    publishing: dict[str, list[str]] = {}
    for m in messages:
        envelope = task_envelope(task_name, m.task_id, m.queue, m.args, m.expires, m.argsrepr)
        by_queue.setdefault(m.queue, []).append((m.expires if m.by_deadline else None, envelope))
        publishing.setdefault(m.queue, []).extend(m.publishing_ids)
    client = _broker()
    if len(by_queue) == 1 and not any(publishing.values()):
        [(queue, envelopes)] = by_queue.items()  # one message: a pipeline would only add cost
        _push(client, client, queue, envelopes)
        return
    pipe = client.pipeline(transaction=False)
    for queue, envelopes in by_queue.items():
        _push(pipe, client, queue, envelopes)
        clear(pipe, queue, publishing[queue])
    pipe.execute()


def _push(
    target: redis.Redis | redis.client.Pipeline,
    client: redis.Redis,
    queue: str,
    envelopes: list[tuple[datetime | None, str]],
) -> None:
    """Queue `envelopes` ((deadline to insert by or None, envelope)) on `queue`."""
    if settings.LLMQUEUE_EDF_WITHIN_TIER and any(due for due, _ in envelopes):
        insert_by_deadline(target, queue, envelopes, client)
    else:
        target.lpush(queue, *(envelope for _, envelope in envelopes))


def publish_task(
    task_name: str,
    task_id: str,
    queue: str,
    args: list[Any],
    expires: datetime | None = None,
    argsrepr: str = "()",
) -> None:
    """Put one task message on `queue`; raises redis.RedisError when the broker refuses it."""
    envelope = task_envelope(task_name, task_id, queue, args, expires, argsrepr)
    _push(_broker(), _broker(), queue, [(None, envelope)])
