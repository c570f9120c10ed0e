"""A Celery task message built by hand, as kombu's Redis channel would LPUSH it for apply_async.

`apply_async` spends ~0.8 ms of CPU per call here (producer pool, routing through the queue's
direct exchange with an SMEMBERS round trip to read its bindings, a fresh Redis client per
command, publish retries wrapped around it all) for what is, on the Redis transport, one LPUSH of
a JSON envelope. That was 1.7 ms of the API's 6.6 ms per request under load (measured, traced).
So the message is built by Celery (`amqp.as_task_v2`, the protocol-2 headers and body a worker
expects) and wrapped the way kombu's Redis channel wraps it; llmqueue/queueing/publisher.py
queues it.
tests/test_broker.py checks the envelope against what `apply_async` puts on the list, so a
Celery or kombu upgrade that changes the format fails a test instead of stranding messages.

What this skips: the `before_task_publish`/`after_task_publish` signals and `task-sent` events
(Flower's task view starts at `task-received`, which workers started with `--events` send).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

from celery import Celery
from kombu.utils.json import dumps

# Lists for message priorities 0-2 (kombu's Redis "priority steps"): every llmqueue message has
# priority 0, and ordering between tiers is done by separate queues, so this is the queue's name.
_PRIORITY = 0


def task_envelope(
    app: Celery,
    task_name: str,
    task_id: str,
    queue: str,
    args: list[Any],
    expires: datetime | None,
    argsrepr: str,
    ignore_result: bool,
    stamp: Callable[[dict[str, Any], datetime | None], None] | None = None,
) -> str:
    """The JSON string kombu's Redis channel would LPUSH for `apply_async(args, task_id=...,
    queue=queue, expires=expires)` sent to the default exchange, for a task declared with
    `ignore_result` (the API does not load the worker's task to read it). `stamp` may add
    headers (they travel with the task and Celery ignores them)."""
    message = app.amqp.as_task_v2(
        task_id, task_name, args=args, kwargs={}, expires=expires,
        argsrepr=argsrepr, kwargsrepr="{}",
        # The header overrides the task's own setting on the worker, as apply_async sets it.
        ignore_result=ignore_result,
    )  # fmt: skip
    if stamp is not None:
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
