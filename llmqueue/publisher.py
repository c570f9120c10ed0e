"""Publishing a generate task: Celery's own task message, queued in one Redis round trip.

`apply_async` spends ~0.8 ms of CPU per call here (producer pool, routing through the queue's
direct exchange with an SMEMBERS round trip to read its bindings, a fresh Redis client per
command, publish retries wrapped around it all) for what is, on the Redis transport, one LPUSH of
a JSON envelope. That was 1.7 ms of the API's 6.6 ms per request under load (measured, traced).
So the message is built by Celery (`amqp.as_task_v2`, the protocol-2 headers and body a worker
expects) and wrapped the way kombu's Redis channel wraps it, then queued with a persistent client:
by its deadline (llmqueue/deadline_order.py: usually one LPUSH inside a script), or with a plain
LPUSH when LLMQUEUE_EDF_WITHIN_TIER is off.
tests/test_broker.py checks the envelope against what `apply_async` puts on the list, so a
Celery or kombu upgrade that changes the format fails a test instead of stranding messages.

What this skips: the `before_task_publish`/`after_task_publish` signals and `task-sent` events
(Flower's task view starts at `task-received`, which workers started with `--events` send).
"""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from typing import Any

import redis
from django.conf import settings
from kombu.utils.json import dumps

from llmqueue.deadline_order import insert_by_deadline, stamp
from project.celery import app

# Lists for message priorities 0-2 (kombu's Redis "priority steps"): every llmqueue message has
# priority 0, and ordering between tiers is done by separate queues, so this is the queue's name.
_PRIORITY = 0


@cache
def _broker() -> redis.Redis:
    return redis.Redis.from_url(app.conf.broker_url)


def task_envelope(
    task_name: str,
    task_id: str,
    queue: str,
    args: list[Any],
    expires: datetime | None,
    argsrepr: str,
) -> str:
    """The JSON string kombu's Redis channel would LPUSH for `apply_async(args, task_id=...,
    queue=queue, expires=expires)` sent to the default exchange."""
    message = app.amqp.as_task_v2(
        task_id, task_name, args=args, kwargs={}, expires=expires,
        argsrepr=argsrepr, kwargsrepr="{}",
        # The header overrides the task's own setting on the worker, as apply_async sets it.
        ignore_result=app.tasks[task_name].ignore_result,
    )  # fmt: skip
    stamp(message.headers, expires)
    body = dumps(message.body).encode("utf-8")
    return str(
        dumps(
            {
                "body": base64.b64encode(body).decode("ascii"),
                "content-encoding": "utf-8",
                "content-type": "application/json",
                "headers": message.headers,
                "properties": {
                    **message.properties,
                    "delivery_mode": 2,
                    "delivery_info": {"exchange": "", "routing_key": queue},
                    "priority": _PRIORITY,
                    "body_encoding": "base64",
                    "delivery_tag": str(uuid.uuid4()),
                },
            }
        )
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


def publish_tasks(task_name: str, messages: list[TaskMessage]) -> None:
    """Put task messages on their queues in one round trip, each queue's in the given order
    (LPUSH several values: a worker's BRPOP takes them oldest first). Raises redis.RedisError
    when the broker refuses them."""
    by_queue: dict[str, list[tuple[datetime | None, str]]] = {}
    for m in messages:
        envelope = task_envelope(task_name, m.task_id, m.queue, m.args, m.expires, m.argsrepr)
        by_queue.setdefault(m.queue, []).append((m.expires if m.by_deadline else None, envelope))
    client = _broker()
    if len(by_queue) == 1:  # an API call's one message: a pipeline would only add cost
        [(queue, envelopes)] = by_queue.items()
        _push(client, client, queue, envelopes)
        return
    pipe = client.pipeline(transaction=False)
    for queue, envelopes in by_queue.items():
        _push(pipe, client, queue, envelopes)
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
