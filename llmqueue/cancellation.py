"""Cancelling requests: the row first, then in one round trip its books settled, a waiting caller
answered and the workers told to abort it.

The row decides (llmqueue/lifecycle.py `cancel`, a conditional UPDATE): a request already finished
keeps its outcome and output, and a worker still running a cancelled one can no longer record
it. What it reserved goes back to its tenant (all of it: how much a running request used is not
known until its worker records it, which it now never does). A held bulk line (not released
yet) is only marked: it reserved nothing and no worker has it. Workers subscribed to
contract.keys.CANCEL_CHANNEL abort it in their engine at the next step, freeing the slot.
"""

from __future__ import annotations

import uuid

from celery import states
from django.utils import timezone

from contract.failures import RequestCancelled
from contract.keys import CANCEL_CHANNEL
from llmqueue import accounting, lifecycle, lifecycle_events, lua
from llmqueue.lifecycle import Ended
from project.celery import app


def cancel_requests(ids: list[uuid.UUID]) -> dict[uuid.UUID, Ended]:
    """Cancel the unfinished ones of `ids`; returns those this call cancelled. Raises
    redis.RedisError if Redis could not be told: the rows stay cancelled (the DB is the source of
    truth), a waiting caller then hears it at its wait's end, and workers at their next claim."""
    now = timezone.now()
    lifecycle.cancel_held(ids, now)  # bulk lines the pacer has not released: nothing to tell
    ended = lifecycle.cancel(ids, now)
    if ended:
        lifecycle_events.log_ended(ended.values())
        tell(list(ended.values()))
    return ended


def tell(ended: list[Ended]) -> None:
    """Settle the books of cancelled requests, answer their waiting callers, tell the workers."""
    backend = app.backend
    pipe = backend.client.pipeline(transaction=False)
    backend.store_many(
        [(str(e.request_id), RequestCancelled(lifecycle.CANCELLED_ERROR), states.FAILURE)
         for e in ended],
        pipe,
    )  # fmt: skip
    accounting.settle(pipe, ended)
    for e in ended:
        pipe.publish(CANCEL_CHANNEL, str(e.request_id))
    lua.execute(pipe)
