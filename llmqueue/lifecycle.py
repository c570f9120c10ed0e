"""A request's state transitions in the DB (claim, finish, expire), batched and race-safe.

Delivery is at-least-once (acks_late, visibility timeout), so every transition is a conditional
UPDATE: only one worker's claim attempt can finish a request, and a finished request is never
claimed again. Each function takes many requests so a worker's one DB thread can batch them.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import connection, transaction

from llmqueue.models import PromptRequest
from llmqueue.timings import NO_TIMING, Timing, epoch, timing_of

S = PromptRequest.Status
EXPIRED_ERROR = "deadline passed before an engine took it"
POISON_ERROR = "every worker that ran it died holding it ({losses} workers lost): not run again"
CANCELLED_ERROR = "cancelled by the caller"
_TABLE = PromptRequest._meta.db_table


@dataclass(frozen=True)
class Ended:
    """A request that reached its final state, with what its books need (llmqueue/accounting)."""

    request_id: uuid.UUID
    tenant_id: int
    tier_id: int
    queue: str
    outcome: str  # "succeeded" | "failed" | "expired" | "cancelled"
    reserved_tokens: int
    prompt_tokens: int = 0
    completion_tokens: int = 0
    was_waiting: bool = False  # no worker had claimed it: it still counted as waiting
    timing: Timing = NO_TIMING


@dataclass(frozen=True)
class Claim:
    """A worker's right to run a request: `attempt` numbers it; None means do not run.
    `ended` is set when the claim expired the request instead; `first` when this claim took the
    request out of its queue's waiting requests (attempt 1)."""

    request_id: uuid.UUID
    attempt: int | None
    expired: bool = False
    tenant_id: int = 0
    queue: str = ""
    ended: Ended | None = None
    tier_id: int = 0
    slack_seconds: float | None = None  # deadline − claim time, on a first claim
    queued_seconds: float | None = None  # admission → this claim

    @property
    def first(self) -> bool:
        return self.attempt == 1


@dataclass(frozen=True)
class Finish:
    """The outcome a claim attempt wants to record."""

    request_id: uuid.UUID
    attempt: int
    succeeded: bool
    output_text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    finish_reason: str = ""
    error: str = ""
    error_code: str = ""  # a contract.failures code: why it failed, for the caller's status
    first_token_at: datetime | None = None  # when the engine produced the first token
    # Seconds from the engine getting the request to its first token: what admission adds to
    # the queue's wait when it judges a request against its tier's first-token target.
    engine_lead_seconds: float | None = None

    def __post_init__(self) -> None:
        # PostgreSQL's text cannot hold NUL, and a model may generate it (the tiny random test
        # model does): one such output failed its whole batch of finishes. The row and the
        # caller get the same text, with U+FFFD where the NUL was.
        for name in ("output_text", "error"):
            text = getattr(self, name)
            if "\x00" in text:
                object.__setattr__(self, name, storable_text(text))


def storable_text(text: str) -> str:
    """`text` as every supported database stores it: NUL as U+FFFD (the replacement char)."""
    return text.replace("\x00", "\ufffd")


def _db_ids(ids: Sequence[uuid.UUID]) -> list[object]:
    pk = PromptRequest._meta.pk
    assert pk is not None
    return [pk.get_db_prep_value(i, connection) for i in ids]


def _placeholders(n: int) -> str:
    return ", ".join(["%s"] * n)


# What every transition returns of the rows it changed: their books (see Ended).
_BOOKS = (
    "id, attempts, tenant_id, tier_id, queue, reserved_tokens, "
    "enqueued_at, started_at, first_token_at, finished_at"
)


@dataclass(frozen=True)
class _Books:
    attempts: int
    tenant_id: int
    tier_id: int
    queue: str
    reserved_tokens: int
    timing: Timing


def _books(row: Sequence[Any]) -> tuple[uuid.UUID, _Books]:
    """One row of _BOOKS's columns."""
    i, attempts, tenant, tier, queue, reserved, *times = row
    timing = timing_of(*times)
    books = _Books(int(attempts), int(tenant), int(tier), str(queue), int(reserved), timing)
    return uuid.UUID(str(i)), books


def _update_returning_books(sql: str, params: list[object]) -> dict[uuid.UUID, _Books]:
    with connection.cursor() as cursor:
        cursor.execute(f"{sql} RETURNING {_BOOKS}", params)
        return dict(_books(row) for row in cursor.fetchall())


def _ended(request_id: uuid.UUID, books: _Books, outcome: str) -> Ended:
    """A request a transition ended without running it to an outcome of its own (expired,
    cancelled, failed as poison); it still counted as waiting if no worker had claimed it."""
    return Ended(
        request_id, books.tenant_id, books.tier_id, books.queue, outcome,
        books.reserved_tokens, was_waiting=books.attempts == 0, timing=books.timing,
    )  # fmt: skip


def expire(
    ids: Sequence[uuid.UUID], now: datetime, overdue_only: bool = False
) -> dict[uuid.UUID, Ended]:
    """Mark unfinished requests expired (only those past their deadline if `overdue_only`);
    returns the ones this call expired."""
    if not ids:
        return {}
    sql = (
        f"UPDATE {_TABLE} SET status = %s, finished_at = %s, error = %s "
        f"WHERE id IN ({_placeholders(len(ids))}) AND status IN (%s, %s)"
    )
    params: list[object] = [S.EXPIRED, now, EXPIRED_ERROR]
    params += [*_db_ids(ids), S.QUEUED, S.RUNNING]
    if overdue_only:
        sql += " AND deadline_at <= %s"
        params.append(now)
    ended = _update_returning_books(sql, params)
    return {i: _ended(i, books, "expired") for i, books in ended.items()}


def cancel(ids: Sequence[uuid.UUID], now: datetime) -> dict[uuid.UUID, Ended]:
    """Mark unfinished requests cancelled; returns the ones this call cancelled. A queued one is
    never claimed now (claims take only queued and running rows); a running one's worker can
    no longer record it (finishes are conditional on the row still running its attempt)."""
    if not ids:
        return {}
    sql = (
        f"UPDATE {_TABLE} SET status = %s, finished_at = %s, error = %s "
        f"WHERE id IN ({_placeholders(len(ids))}) AND status IN (%s, %s)"
    )
    params: list[object] = [S.CANCELLED, now, CANCELLED_ERROR, *_db_ids(ids), S.QUEUED, S.RUNNING]
    ended = _update_returning_books(sql, params)
    return {i: _ended(i, books, "cancelled") for i, books in ended.items()}


def cancel_held(ids: Sequence[uuid.UUID], now: datetime) -> int:
    """Mark held bulk lines cancelled (they never reached the broker, reserved nothing and
    count as waiting nowhere: there are no books to settle); returns how many."""
    if not ids:
        return 0
    return PromptRequest.objects.filter(pk__in=ids, status=S.HELD).update(
        status=S.CANCELLED, finished_at=now, error=CANCELLED_ERROR
    )


def hand_back(attempts: Sequence[tuple[uuid.UUID, int]]) -> int:
    """Put requests a stopping worker hands back (request, its attempt) back to queued: their
    messages are back on their queues, and the next claim takes them over as no lost worker.
    Only rows still running under that attempt change; returns how many did."""
    if not attempts:
        return 0
    match = " OR ".join(["(id = %s AND attempts = %s)"] * len(attempts))
    params: list[object] = [S.QUEUED, S.RUNNING]
    ids = _db_ids([request_id for request_id, _ in attempts])
    for db_id, (_, attempt) in zip(ids, attempts, strict=True):
        params += [db_id, attempt]
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {_TABLE} SET status = %s WHERE status = %s AND ({match})", params)
        return int(cursor.rowcount)


def expire_overdue(now: datetime, limit: int = 500) -> dict[uuid.UUID, Ended]:
    """Mark queued requests whose deadline passed expired, at most `limit` of them (the oldest
    deadlines first); returns the ones this call expired. Their messages may still be deep in a
    queue: when one reaches a worker its claim finds the row finished and drops it. Running
    requests are left alone: they reached an engine in time."""
    sql = (
        f"UPDATE {_TABLE} SET status = %s, finished_at = %s, error = %s WHERE id IN ("
        f"SELECT id FROM {_TABLE} WHERE status = %s AND deadline_at <= %s "
        f"ORDER BY deadline_at LIMIT %s) AND status = %s"
    )
    params: list[object] = [S.EXPIRED, now, EXPIRED_ERROR, S.QUEUED, now, limit, S.QUEUED]
    ended = _update_returning_books(sql, params)
    return {i: _ended(i, books, "expired") for i, books in ended.items()}


def claim(
    ids: Sequence[uuid.UUID], worker: str, now: datetime, max_losses: int = 0
) -> dict[uuid.UUID, Claim]:
    """Claim requests for `worker`. A queued request is claimed; a running one too, since its
    message was redelivered (its worker died, or the visibility timeout passed): the new attempt
    takes over and the old one can no longer finish it, and its worker counts as lost (a
    deploy's hand-back first puts the row back to queued: no loss). Overdue requests are expired
    instead, and one whose `max_losses`-th lost worker this is (0: no limit) is failed: a poison
    request, not run again.

    One statement does it all: every SET expression sees the row as it was, so each request is
    expired, failed or claimed by its own deadline and losses, and one round trip is on every
    request's path.
    """
    if not ids:
        return {}
    lost = "status = %s"
    poison, poison_values = (
        (f"{lost} AND worker_losses + 1 >= %s", [S.RUNNING, max_losses])
        if max_losses > 0
        else ("1 = 0", [])
    )
    poison_error = POISON_ERROR.format(losses=max_losses)

    def case(
        expired: str, failed: str, running: str, values: tuple[list[object], ...] = ([], [], [])
    ) -> tuple[str, list[object]]:
        """One column's CASE: expired by the deadline, failed as poison, else claimed; its
        parameters in the order the placeholders appear."""
        sql = f"CASE WHEN deadline_at <= %s THEN {expired} WHEN {poison} THEN {failed} "
        sql += f"ELSE {running} END"
        return sql, [now, *values[0], *poison_values, *values[1], *values[2]]

    columns: dict[str, tuple[str, list[object]]] = {
        "status": case("%s", "%s", "%s", ([S.EXPIRED], [S.FAILED], [S.RUNNING])),
        "attempts": case("attempts", "attempts", "attempts + 1"),
        "worker": case("worker", "worker", "%s", ([], [], [worker])),
        "started_at": case("started_at", "started_at", "%s", ([], [], [now])),
        "finished_at": case("%s", "%s", "finished_at", ([now], [now], [])),
        "error": case("%s", "%s", "error", ([EXPIRED_ERROR], [poison_error], [])),
        "worker_losses": (
            f"CASE WHEN {lost} THEN worker_losses + 1 ELSE worker_losses END",
            [S.RUNNING],
        ),
    }
    params: list[object] = [p for _, values in columns.values() for p in values]
    sets = {column: sql for column, (sql, _) in columns.items()}
    sql = (
        f"UPDATE {_TABLE} SET {', '.join(f'{c} = {e}' for c, e in sets.items())} "
        f"WHERE id IN ({_placeholders(len(ids))}) AND status IN (%s, %s) "
        f"RETURNING status, deadline_at, {_BOOKS}"
    )
    params += [*_db_ids(ids), S.QUEUED, S.RUNNING]
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        rows = {}
        for status, deadline, *books_row in cursor.fetchall():
            i, books = _books(books_row)
            rows[i] = (status, epoch(deadline), books)
    claims = {}
    for i in ids:
        if i not in rows:
            claims[i] = Claim(i, None)
            continue
        status, deadline, books = rows[i]
        if status in (S.EXPIRED, S.FAILED):
            ended = _ended(i, books, "expired" if status == S.EXPIRED else "failed")
            claims[i] = Claim(i, None, True, books.tenant_id, books.queue, ended, books.tier_id)
            continue
        slack = None
        if books.attempts == 1 and deadline is not None:
            slack = deadline - now.timestamp()
        queued = books.timing.since_enqueued(now.timestamp())
        claims[i] = Claim(
            i, books.attempts, False, books.tenant_id, books.queue, None, books.tier_id, slack,
            queued,
        )  # fmt: skip
    return claims


# column → its value's placeholder. PostgreSQL types a CASE by its branches: integer columns say
# so, or a batch whose values are all NULL (failures have no token counts) reads as text.
_FINISH_COLUMNS = {
    "status": "%s",
    "output_text": "%s",
    "prompt_tokens": "CAST(%s AS INTEGER)",
    "completion_tokens": "CAST(%s AS INTEGER)",
    "finish_reason": "%s",
    "error": "%s",
    "first_token_at": "%s",
}
# Outcomes per UPDATE: 16 parameters each stays far below SQLite's and PostgreSQL's limits.
_FINISH_BATCH = 200


def _finish_values(o: Finish) -> tuple[object, ...]:
    status = S.SUCCEEDED if o.succeeded else S.FAILED
    return (
        status, o.output_text, o.prompt_tokens, o.completion_tokens, o.finish_reason, o.error,
        o.first_token_at,
    )  # fmt: skip


def _finish_columns() -> dict[str, str]:
    if connection.vendor == "postgresql":  # a CASE of only NULLs would read as text
        return {**_FINISH_COLUMNS, "first_token_at": "CAST(%s AS TIMESTAMP WITH TIME ZONE)"}
    return _FINISH_COLUMNS


def _finish_batch(outcomes: Sequence[Finish], now: datetime) -> dict[uuid.UUID, Ended]:
    """One UPDATE for outcomes of distinct requests: each column is a CASE over the ids, and
    only rows still running under the outcome's own attempt are touched."""
    ids = _db_ids([o.request_id for o in outcomes])
    values = [_finish_values(o) for o in outcomes]
    columns = _finish_columns()
    sets = ", ".join(
        f"{column} = CASE id {' '.join(f'WHEN %s THEN {value}' for _ in outcomes)} END"
        for column, value in columns.items()
    )
    matches = " OR ".join("(id = %s AND attempts = %s)" for _ in outcomes)
    params: list[object] = []
    for column_index in range(len(columns)):
        for db_id, row in zip(ids, values, strict=True):
            params += [db_id, row[column_index]]
    params += [now, S.RUNNING]
    for db_id, o in zip(ids, outcomes, strict=True):
        params += [db_id, o.attempt]
    sql = f"UPDATE {_TABLE} SET {sets}, finished_at = %s WHERE status = %s AND ({matches})"
    by_id = {o.request_id: o for o in outcomes}
    return {
        i: Ended(
            i,
            books.tenant_id,
            books.tier_id,
            books.queue,
            "succeeded" if by_id[i].succeeded else "failed",
            books.reserved_tokens,
            by_id[i].prompt_tokens or 0,
            by_id[i].completion_tokens or 0,
            timing=books.timing,
        )
        for i, books in _update_returning_books(sql, params).items()
    }


def finish(outcomes: Sequence[Finish], now: datetime) -> dict[uuid.UUID, Ended]:
    """Record outcomes; returns the requests whose attempt still held the claim (the only ones
    whose result may be published, and whose books are settled). A worker's recorder hands a
    whole batch at once: a few statements for dozens of requests that finished at one step."""
    seen: set[uuid.UUID] = set()
    distinct: list[Finish] = []
    repeated: list[Finish] = []
    for o in outcomes:  # two attempts of one request in one batch: each needs its own statement
        (repeated if o.request_id in seen else distinct).append(o)
        seen.add(o.request_id)
    won: dict[uuid.UUID, Ended] = {}
    with transaction.atomic():
        for start in range(0, len(distinct), _FINISH_BATCH):
            won |= _finish_batch(distinct[start : start + _FINISH_BATCH], now)
        for o in repeated:
            won |= _finish_batch([o], now)
    return won
