"""A worker's single DB thread: it records claims and outcomes in batches, then publishes outcomes.

A GPU worker runs ~100+ task slots; one DB connection each would exhaust PostgreSQL's
max_connections and contend on SQLite's lock. One thread with one connection takes whatever
accumulated while its last batch ran, so a lone request waits for nothing and a burst costs a
few statements instead of hundreds.

It is also the only writer of outcomes to Celery's result backend: a finished, failed or expired
request is committed to its row first (the source of truth), then published, all winners of a
batch in one pipeline. Publishing here rather than from the task's thread saves the task thread
a wake-up on every request's critical path (the generate task has `ignore_result`). A second
round trip settles the ended requests' books (token refunds, usage: llmqueue/accounting.py) and
counts the claims (each queue's drain rate, which admission's wait estimate reads); every few
seconds the thread also moves usage counters into the DB.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import redis
from celery import states
from celery.exceptions import TaskRevokedError
from django.conf import settings
from django.db import DatabaseError, close_old_connections, connection
from django.utils import timezone

from contract.failures import FAILURES, GenerationError, PoisonRequest
from llmqueue import accounting, lifecycle, lifecycle_events, lua, usage

log = logging.getLogger(__name__)

EXPIRED_REASON = "expired"
_CLAIM_BOOKS_WAIT_SECONDS = 0.05
# How often the thread lets Django look at its connection (max age; on PostgreSQL the health
# check, a SELECT 1 round trip). Once per batch it was one more DB round trip per batch, often
# on a request's critical path (claim and finish are batches of their own when traffic is
# light); a failed batch closes the connection at once, so the next one reconnects anyway.
_CONNECTION_CHECK_SECONDS = 1.0


@dataclass(frozen=True)
class Recorded:
    """What became of an outcome: `won` if this attempt still held the claim and its row was
    written; `published` if the result backend has it too."""

    won: bool
    published: bool = False


_Job = tuple[str, Any, Future[Any]]


@dataclass
class Books:
    """What one batch sends to Redis in one round trip, after its rows are committed."""

    results: list[tuple[str, Any, str]] = field(default_factory=list)  # for the result backend
    ended: list[lifecycle.Ended] = field(default_factory=list)  # refunds and usage to settle
    claims: list[lifecycle.Claim] = field(default_factory=list)  # drain rates, waiting counts
    leads: list[tuple[str, float]] = field(default_factory=list)  # (queue, engine lead seconds)

    def __bool__(self) -> bool:
        return bool(self.results or self.ended or self.claims or self.leads)

    def add(self, other: Books) -> None:
        self.results += other.results
        self.ended += other.ended
        self.claims += other.claims
        self.leads += other.leads


def send_books(books: Books) -> None:
    """The worker's default publisher: the results callers wait for, then settlements and claim
    counts, each in one pipeline.

    The results go first, on their own: building and parsing the books' pipeline (refunds,
    usage, drain and latency counts: ~20 commands) took ~1 ms of the recorder's CPU before a
    waiting caller heard of its result (bench/latency.py), against one more round trip per
    batch (~0.2 ms) for the recorder. Redis still applies a request's settlement after its
    result is stored, as it did in one pipeline."""
    from project.celery import app

    backend = app.backend

    def send_rest() -> None:
        pipe = backend.client.pipeline(transaction=False)
        accounting.settle(pipe, books.ended)
        accounting.count_claims(pipe, books.claims)
        accounting.count_leads(pipe, books.leads)
        lua.execute(pipe)

    if books.results:
        backend.store_many(books.results)  # retried as `ensure` retries
    if not (books.ended or books.claims or books.leads):
        return
    try:
        backend.ensure(send_rest, ())
    except redis.RedisError:
        # The results are out and their callers have them: a failure here is not a failed
        # publish. What it loses is bookkeeping (a refund, usage, a drain count), as before.
        log.exception(
            "settling %d ended requests and %d claims failed after their results were sent",
            len(books.ended),
            len(books.claims),
        )


def _revoked(request_id: uuid.UUID) -> tuple[str, Any, str]:
    return str(request_id), TaskRevokedError(EXPIRED_REASON), states.REVOKED


def _ended_at_claim(ended: lifecycle.Ended) -> tuple[str, Any, str]:
    """The result of a request its claim ended: expired, or failed for the workers it killed."""
    if ended.outcome == "failed":
        losses = settings.LLMQUEUE_MAX_WORKER_LOSSES
        error = PoisonRequest(lifecycle.POISON_ERROR.format(losses=losses))
        return str(ended.request_id), error, states.FAILURE
    return _revoked(ended.request_id)


def result_of(outcome: lifecycle.Finish, queue_seconds: float | None = None) -> tuple[Any, str]:
    """The value and state the result backend stores for an outcome; `queue_seconds` (admission
    to claim) goes to the caller as X-LLMQueue-Queue-Seconds."""
    if outcome.succeeded:
        return {
            "text": outcome.output_text,
            "prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            "finish_reason": outcome.finish_reason,
            "queue_seconds": queue_seconds,
        }, states.SUCCESS
    failure = FAILURES.get(outcome.error_code, GenerationError)
    return failure(outcome.error), states.FAILURE


def queued_seconds(ended: lifecycle.Ended) -> float | None:
    t = ended.timing
    return t.since_enqueued(t.started)


class Recorder:
    def __init__(
        self,
        publish: Callable[[Books], None],
        flush_usage: Callable[[], object] | None = None,
        flush_every_seconds: float = 10.0,
    ) -> None:
        """`publish(books)` sends a batch's results, settlements and claim counts to Redis;
        `flush_usage()` runs every `flush_every_seconds` (usage counters into the DB)."""
        self._publish = publish
        self._flush_usage = flush_usage
        self._flush_every = flush_every_seconds
        self._next_flush = time.monotonic() + flush_every_seconds
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        # Books of this round (and claim counts of earlier ones) for one pipeline, and who
        # waits for it to be sent.
        self._books = Books()
        self._on_sent: list[Callable[[bool], None]] = []
        self._books_since: float | None = None
        self._connection_checked = 0.0
        # Whether jobs were submitted that the thread has not recorded and sent yet.
        self._working = False
        self._quiet = threading.Condition()
        # Event lines to write once the round trip they belong to is sent (`_log`).
        self._events: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._thread = threading.Thread(target=self._run, name="llmqueue-recorder", daemon=True)
        self._thread.start()

    def claim(self, request_id: uuid.UUID, worker: str) -> Future[lifecycle.Claim]:
        return self._submit("claim", (request_id, worker))

    def finish(self, outcome: lifecycle.Finish) -> Future[Recorded]:
        """Record `outcome` if its attempt still holds the claim, then publish it."""
        return self._submit("finish", outcome)

    def hand_back(self, request_id: uuid.UUID, attempt: int) -> Future[int]:
        """Put a request the stopping worker hands back to queued (lifecycle.hand_back), so
        the next claim does not count this worker as lost; the future holds 1 if it did."""
        return self._submit("hand_back", (request_id, attempt))

    def expire(self, request_id: uuid.UUID) -> Future[Recorded]:
        """Mark an unfinished request expired (Celery dropped its message), then publish that."""
        return self._submit("expire", request_id)

    def sweep(self, limit: int = 500) -> Future[int]:
        """Expire queued requests past their deadline (at most `limit`), publish that and settle
        their books; the future holds how many were expired."""
        return self._submit("sweep", limit)

    def close(self, timeout_seconds: float = 10) -> None:
        """Record and send what was submitted before, then end the thread and its DB
        connection."""
        self._submit("close", None).result(timeout=timeout_seconds)
        self._thread.join(timeout=timeout_seconds)

    def wait_quiet(self, timeout_seconds: float) -> bool:
        """Wait until the thread has recorded and sent everything submitted so far (at most
        `timeout_seconds`); whether it has."""
        with self._quiet:
            return self._quiet.wait_for(lambda: not self._working, timeout_seconds)

    def _submit(self, op: str, item: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self._working = True  # before the put: a waiter must not take the thread for quiet
        self._jobs.put((op, item, future))
        return future

    def _note_quiet(self) -> None:
        with self._quiet:
            if self._jobs.empty():
                self._working = False
                self._quiet.notify_all()

    def _run(self) -> None:
        while True:
            if self._working and self._jobs.empty():
                self._note_quiet()
            try:
                jobs = [self._jobs.get(timeout=max(0.0, self._next_flush - time.monotonic()))]
            except queue.Empty:
                self._flush()
                continue
            while True:
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            for op, handler in (
                ("claim", self._claims),
                ("hand_back", self._hand_backs),
                ("expire", self._expiries),
                ("finish", self._finishes),
                ("sweep", self._sweeps),
            ):
                batch = [j for j in jobs if j[0] == op]
                if batch:
                    self._apply(batch, handler)
            self._send_books()
            closing = [j for j in jobs if j[0] == "close"]
            if closing:
                self._send_books(force=True)  # claim counts that waited for a next round
                connection.close()
                for job in closing:
                    job[2].set_result(None)
                return
            if time.monotonic() >= self._next_flush:
                self._flush()

    def _flush(self) -> None:
        self._next_flush = time.monotonic() + self._flush_every
        if self._flush_usage is None:
            return
        close_old_connections()
        try:
            self._flush_usage()
        except Exception:
            log.exception("flushing usage counters failed; they stay in Redis for the next try")
            connection.close()

    def _check_connection(self) -> None:
        now = time.monotonic()
        if now - self._connection_checked >= _CONNECTION_CHECK_SECONDS:
            self._connection_checked = now
            close_old_connections()

    def _apply(self, batch: list[_Job], handler: Callable[[list[_Job]], None]) -> None:
        self._check_connection()
        try:
            try:
                handler(batch)
            except DatabaseError:
                # Most batches skip Django's connection check: a connection the server dropped
                # since (a restart, a failover, an idle timeout) fails here instead, so the
                # batch runs once more on a new one. A statement that failed did not commit;
                # one whose commit's answer was lost is answered again by the conditional
                # UPDATEs (a claim takes its own row over, a finish is refused: not won).
                log.warning(
                    "recording %d %s jobs failed; retrying on a new connection",
                    len(batch),
                    batch[0][0],
                    exc_info=True,
                )
                connection.close()
                handler(batch)
        except Exception as exc:
            log.exception("recording %d %s jobs failed", len(batch), batch[0][0])
            connection.close()  # a broken connection must not poison the next batch
            for _, _, future in batch:
                if not future.done():
                    future.set_exception(exc)

    def _claims(self, batch: list[_Job]) -> None:
        by_worker: dict[str, list[_Job]] = {}
        for job in batch:
            by_worker.setdefault(job[1][1], []).append(job)
        claims: dict[uuid.UUID, lifecycle.Claim] = {}
        claimed_by: dict[str, list[uuid.UUID]] = {}
        for worker, jobs in by_worker.items():
            claimed_by[worker] = ids = list(dict.fromkeys(j[1][0] for j in jobs))
            max_losses = settings.LLMQUEUE_MAX_WORKER_LOSSES
            claims.update(lifecycle.claim(ids, worker, timezone.now(), max_losses))
        seen: set[uuid.UUID] = set()
        for _, (request_id, _), future in batch:
            # The same id twice in one batch: a duplicate delivery; only one may run it.
            outcome = claims[request_id]
            if request_id in seen and outcome.attempt is not None:
                outcome = lifecycle.Claim(request_id, None)
            seen.add(request_id)
            future.set_result(outcome)
        for worker, ids in claimed_by.items():
            self._log(lifecycle_events.log_claims, [claims[i] for i in ids], worker)
        # After the claimed requests went on to the engine (the futures' callbacks ran): the
        # expiries the claim made instead (REVOKED, their books), and what the claims drained.
        ended = [c.ended for c in claims.values() if c.ended is not None]
        results = [_ended_at_claim(e) for e in ended]
        self._defer(Books(results, ended, list(claims.values())))

    def _hand_backs(self, batch: list[_Job]) -> None:
        lifecycle.hand_back([job[1] for job in batch])
        for job in batch:  # one UPDATE for all: each job learns only that it committed
            job[2].set_result(1)

    def _expiries(self, batch: list[_Job]) -> None:
        expired = lifecycle.expire([j[1] for j in batch], timezone.now())
        ended = list(expired.values())
        books = Books([_revoked(e.request_id) for e in ended], ended)
        self._settle(batch, books, lambda job: job[1] in expired)

    def _sweeps(self, batch: list[_Job]) -> None:
        expired = lifecycle.expire_overdue(timezone.now(), max(j[1] for j in batch))
        ended = list(expired.values())

        def sent(published: bool) -> None:  # a failed publish is logged; the rows say expired
            for job in batch:
                job[2].set_result(len(ended))

        self._defer(Books([_revoked(e.request_id) for e in ended], ended), sent)

    def _finishes(self, batch: list[_Job]) -> None:
        won = lifecycle.finish([j[1] for j in batch], timezone.now())
        results = [
            (str(o.request_id), *result_of(o, queued_seconds(won[o.request_id])))
            for o in (j[1] for j in batch)
            if o.request_id in won
        ]
        leads = [
            (won[o.request_id].queue, o.engine_lead_seconds)
            for o in (j[1] for j in batch)
            if o.request_id in won and o.engine_lead_seconds is not None
        ]
        books = Books(results, list(won.values()), leads=leads)
        outputs = None
        if settings.LLMQUEUE_EVENT_LOG_TEXT:
            outputs = {str(j[1].request_id): j[1].output_text for j in batch}
        self._settle(batch, books, lambda job: job[1].request_id in won, outputs)

    def _settle(
        self,
        batch: list[_Job],
        books: Books,
        won: Callable[[_Job], bool],
        outputs: dict[str, str] | None = None,
    ) -> None:
        """Publish the committed outcomes, then tell each job what became of it. A publish that
        fails leaves the outcome in its row (pollable); the blocking caller then times out."""

        def sent(published: bool) -> None:
            for job in batch:
                job[2].set_result(Recorded(won(job), published and won(job)))

        self._defer(books, sent, outputs)

    def _defer(
        self,
        books: Books,
        on_sent: Callable[[bool], None] | None = None,
        outputs: dict[str, str] | None = None,
    ) -> None:
        """Add `books` to the next round trip; the requests they end are logged once it is
        sent (their rows are committed)."""
        self._log(lifecycle_events.log_ended, books.ended, outputs)
        self._books.add(books)
        if on_sent is not None:
            self._on_sent.append(on_sent)
        if self._books_since is None:
            self._books_since = time.monotonic()

    def _log(self, log_events: Callable[..., None], *args: Any) -> None:
        """Write event lines (llmqueue/lifecycle_events.py) once the books they go with are
        sent: ~0.15 ms of Python per line, which came between a claim and its request's finish,
        and between a finish and its publish, on the path of every short request."""
        self._events.append((log_events, args))

    def _send_books(self, force: bool = False) -> None:
        """One pipeline for the round's books, once its rows are committed. Claim counts alone
        (nobody waits for them) ride along with the next round's while more jobs are queued: a
        claim is mostly followed by its finish, so a short request's outcome goes out one round
        trip sooner (bounded: claim counts wait at most `_CLAIM_BOOKS_WAIT_SECONDS`). The
        round's event lines follow, once the outcomes are out and their jobs told."""
        if self._books_since is None:
            return
        if (
            not force
            and not self._on_sent
            and not self._books.results  # a caller may wait for an expiry's REVOKED
            and not self._jobs.empty()
            and time.monotonic() - self._books_since < _CLAIM_BOOKS_WAIT_SECONDS
        ):
            return
        books, on_sent, events = self._books, self._on_sent, self._events
        self._books, self._on_sent, self._events, self._books_since = Books(), [], [], None
        published = self._send(books)
        for callback in on_sent:
            try:
                callback(published)
            except Exception:  # one waiter's failure must not strand the others
                log.exception("telling a job its books were sent failed")
        for log_events, args in events:  # in the order they happened
            try:
                log_events(*args)
            except Exception:  # a log line must not stop the recording
                log.exception("writing lifecycle events failed")

    def _send(self, books: Books) -> bool:
        if not books:
            return True
        try:
            self._publish(books)
        except Exception:
            log.exception(
                "publishing %d outcomes (%d settlements) failed; their rows have them",
                len(books.results),
                len(books.ended),
            )
            return False
        return True


def new_recorder() -> Recorder:
    """A worker's recorder: books sent to Redis, usage counters flushed to the DB every
    LLMQUEUE_USAGE_FLUSH_SECONDS (one per worker process: workers/runtime.py builds it)."""
    return Recorder(send_books, usage.flush, settings.LLMQUEUE_USAGE_FLUSH_SECONDS)
