"""The rows' transitions as event lines (contract/events.py): dispatched, first token, ended.

Written by whoever made the transition, after its rows are committed: a worker's recorder for
claims, finishes and expiries, the API for cancellations. Timings come from the rows' own times
(llmqueue/timings.py), so a line says when the event happened, not when it was logged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from contract import events
from contract.queues import Lane
from llmqueue.lifecycle import Claim, Ended
from llmqueue.models import PromptRequest

_EVENT_OF_OUTCOME = {"expired": events.EXPIRED, "cancelled": events.CANCELLED}


def _where(queue: str) -> dict[str, object]:
    """pool, tier and queue of a request's queue name."""
    lane = Lane.of_queue(queue)
    return {"pool": lane.pool or None, "tier": lane.tier or None, "queue": queue or None}


def log_admitted(rows: Iterable[PromptRequest], tenant: str, with_text: bool = False) -> None:
    """`admitted` for requests stored and published to their queue (with the prompt only if
    `with_text`: LLMQUEUE_EVENT_LOG_TEXT)."""
    if not events.enabled():
        return
    for row in rows:
        fields = {
            "request_id": str(row.id), "tenant_id": row.tenant_id, "tenant": tenant,
            **_where(row.queue), "model": row.model, "reserved_tokens": row.reserved_tokens,
            "deadline_seconds": (row.deadline_at - row.enqueued_at).total_seconds(),
            "prompt": (row.prompt or row.messages) if with_text else None,
        }  # fmt: skip
        events.emit(events.ADMITTED, fields, at=row.enqueued_at.timestamp())


def log_claims(claims: Iterable[Claim], worker: str) -> None:
    """`dispatched` for each claim that lets a worker run its request."""
    if not events.enabled():
        return
    for c in claims:
        if c.attempt is None:
            continue
        fields = {
            "request_id": str(c.request_id), "tenant_id": c.tenant_id, **_where(c.queue),
            "worker": worker, "attempt": c.attempt, "queue_seconds": c.queued_seconds,
            "deadline_slack_seconds": c.slack_seconds,
        }  # fmt: skip
        events.emit(events.DISPATCHED, fields)


def log_ended(ended: Iterable[Ended], outputs: Mapping[str, str] | None = None) -> None:
    """`first_token` (at its step's time) and `finished` for requests that ran to an outcome,
    `expired` or `cancelled` for the others. `outputs` (request id → text) only when
    LLMQUEUE_EVENT_LOG_TEXT is on."""
    if not events.enabled():
        return
    for e in ended:
        t, request_id = e.timing, str(e.request_id)
        common = {"request_id": request_id, "tenant_id": e.tenant_id, **_where(e.queue)}
        if t.first_token is not None:
            ttft = {**common, "ttft_seconds": t.since_enqueued(t.first_token)}
            events.emit(events.FIRST_TOKEN, ttft, at=t.first_token)
        ended_fields = {
            **common,
            "outcome": e.outcome,
            "queue_seconds": t.since_enqueued(t.started),
            "total_seconds": t.since_enqueued(t.finished),
            "prompt_tokens": e.prompt_tokens or None,
            "completion_tokens": e.completion_tokens or None,
            "output": None if outputs is None else outputs.get(request_id),
        }
        events.emit(_EVENT_OF_OUTCOME.get(e.outcome, events.FINISHED), ended_fields, at=t.finished)
