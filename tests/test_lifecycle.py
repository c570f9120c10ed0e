"""Claims and finishes in the DB: at-least-once delivery, exactly-once outcome."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from llmqueue import lifecycle
from llmqueue.defaults import create_tenant_with_key, ensure_default_tiers
from llmqueue.models import PromptRequest
from llmqueue.timings import Timing

pytestmark = pytest.mark.django_db
S = PromptRequest.Status


def make_request(deadline_seconds: float = 60) -> PromptRequest:
    tiers = ensure_default_tiers()
    tenant, _ = create_tenant_with_key("acme", tiers["interactive"])
    now = timezone.now()
    return PromptRequest.objects.create(
        tenant=tenant,
        tier=tiers["interactive"],
        model="sim",
        kind="completion",
        prompt="hi",
        queue="default.interactive",
        reserved_tokens=50,
        enqueued_at=now,
        deadline_at=now + timedelta(seconds=deadline_seconds),
    )


def timing_of(row: PromptRequest) -> Timing:
    """The times a transition returns for `row`, read back from the DB."""
    row.refresh_from_db()
    times = (row.enqueued_at, row.started_at, row.first_token_at, row.finished_at)
    return Timing(*(None if t is None else t.timestamp() for t in times))


def done(request_id: uuid.UUID, attempt: int, text: str = "out") -> lifecycle.Finish:
    return lifecycle.Finish(request_id, attempt, True, text, 2, 3, "length")


def test_claim_then_finish_records_the_outcome_once():
    row = make_request()
    now = timezone.now()
    assert lifecycle.claim([row.id], "w1", now)[row.id].attempt == 1
    assert lifecycle.finish([done(row.id, 1)], now).keys() == {row.id}
    assert lifecycle.finish([done(row.id, 1, "again")], now) == {}
    row.refresh_from_db()
    assert (row.status, row.output_text, row.attempts, row.worker) == (S.SUCCEEDED, "out", 1, "w1")
    assert (row.prompt_tokens, row.completion_tokens, row.finish_reason) == (2, 3, "length")
    # A late redelivery of a finished request is not run again.
    assert lifecycle.claim([row.id], "w2", now)[row.id] == lifecycle.Claim(row.id, None)


def test_redelivered_running_request_is_taken_over_and_the_old_attempt_cannot_finish():
    row = make_request()
    now = timezone.now()
    assert lifecycle.claim([row.id], "dead", now)[row.id].attempt == 1
    assert lifecycle.claim([row.id], "alive", now)[row.id].attempt == 2
    assert lifecycle.finish([done(row.id, 1, "stale")], now) == {}
    assert lifecycle.finish([done(row.id, 2, "fresh")], now).keys() == {row.id}
    row.refresh_from_db()
    assert (row.output_text, row.worker, row.attempts) == ("fresh", "alive", 2)


def test_overdue_request_is_expired_not_claimed():
    row = make_request(deadline_seconds=-1)
    claim = lifecycle.claim([row.id], "w1", timezone.now())[row.id]
    # Its books go back with it: never claimed, so it counted as waiting in its queue.
    ended = lifecycle.Ended(
        row.id, row.tenant_id, row.tier_id, "default.interactive", "expired", 50,
        was_waiting=True, timing=timing_of(row),
    )  # fmt: skip
    assert claim == lifecycle.Claim(
        row.id, None, True, row.tenant_id, row.queue, ended, row.tier_id
    )
    assert ended.timing.started is None and ended.timing.finished is not None
    row.refresh_from_db()
    assert (row.status, row.attempts, row.started_at) == (S.EXPIRED, 0, None)
    assert row.finished_at is not None


def test_failure_is_recorded_with_its_error():
    row = make_request()
    now = timezone.now()
    lifecycle.claim([row.id], "w1", now)
    failure = lifecycle.Finish(row.id, 1, succeeded=False, error="prompt too long")
    assert lifecycle.finish([failure], now).keys() == {row.id}
    row.refresh_from_db()
    assert (row.status, row.error, row.output_text) == (S.FAILED, "prompt too long", "")


def test_batched_claims_mix_outcomes():
    fresh, overdue, finished = make_request(), make_request(-1), make_request()
    now = timezone.now()
    lifecycle.claim([finished.id], "w0", now)
    lifecycle.finish([done(finished.id, 1)], now)
    claims = lifecycle.claim([fresh.id, overdue.id, finished.id], "w1", now)
    tenant, queue = fresh.tenant_id, "default.interactive"
    expired = lifecycle.Ended(
        overdue.id, tenant, fresh.tier_id, queue, "expired", 50, 0, 0, True, timing_of(overdue)
    )
    # A first claim says how far from its deadline the request was taken.
    slack = (fresh.deadline_at - now).total_seconds()
    assert claims[fresh.id].slack_seconds == pytest.approx(slack, abs=1e-5)
    # ... and how long it waited for it.
    queued = (now - fresh.enqueued_at).total_seconds()
    assert claims[fresh.id].queued_seconds == pytest.approx(queued, abs=1e-5)
    took = claims[fresh.id]
    assert claims == {
        fresh.id: lifecycle.Claim(
            fresh.id,
            1,
            False,
            tenant,
            queue,
            None,
            fresh.tier_id,
            took.slack_seconds,
            took.queued_seconds,
        ),
        overdue.id: lifecycle.Claim(overdue.id, None, True, tenant, queue, expired, fresh.tier_id),
        finished.id: lifecycle.Claim(finished.id, None),
    }
    assert claims[fresh.id].first and not claims[finished.id].first


def test_expire_leaves_finished_requests_alone():
    row = make_request()
    now = timezone.now()
    lifecycle.claim([row.id], "w1", now)
    lifecycle.finish([done(row.id, 1)], now)
    assert lifecycle.expire([row.id], now) == {}
    row.refresh_from_db()
    assert row.status == S.SUCCEEDED


def test_batched_finish_records_each_outcome_under_its_own_attempt():
    ok, failed, stale, twice = (make_request() for _ in range(4))
    now = timezone.now()
    lifecycle.claim([ok.id, failed.id, stale.id, twice.id], "w1", now)
    lifecycle.claim([stale.id, twice.id], "w2", now)  # redelivered: attempt 2 took them over
    won = lifecycle.finish(
        [
            done(ok.id, 1, "first"),
            lifecycle.Finish(failed.id, 1, succeeded=False, error="engine said no"),
            done(stale.id, 1, "too late"),
            done(twice.id, 1, "old attempt"),
            done(twice.id, 2, "new attempt"),
        ],
        now,
    )
    assert won.keys() == {ok.id, failed.id, twice.id}
    # What each settles: the reservation against what it used (2 prompt + 3 completion tokens).
    assert (won[ok.id].outcome, won[ok.id].reserved_tokens) == ("succeeded", 50)
    assert (won[ok.id].prompt_tokens, won[ok.id].completion_tokens) == (2, 3)
    assert (won[failed.id].outcome, won[failed.id].prompt_tokens) == ("failed", 0)
    assert not any(e.was_waiting for e in won.values())
    rows = {r.id: r for r in PromptRequest.objects.all()}
    assert (rows[ok.id].status, rows[ok.id].output_text) == (S.SUCCEEDED, "first")
    assert (rows[ok.id].prompt_tokens, rows[ok.id].completion_tokens) == (2, 3)
    assert (rows[failed.id].status, rows[failed.id].error) == (S.FAILED, "engine said no")
    assert (rows[failed.id].output_text, rows[failed.id].prompt_tokens) == ("", None)
    assert (rows[stale.id].status, rows[stale.id].output_text) == (S.RUNNING, "")
    assert (rows[twice.id].status, rows[twice.id].output_text) == (S.SUCCEEDED, "new attempt")
    assert rows[twice.id].finished_at == now


def test_finish_records_when_the_first_token_came():
    row = make_request()
    now = timezone.now()
    lifecycle.claim([row.id], "w1", now)
    first = now - timedelta(milliseconds=250)
    outcome = lifecycle.Finish(row.id, 1, True, "out", 2, 3, "length", first_token_at=first)
    assert lifecycle.finish([outcome], now).keys() == {row.id}
    row.refresh_from_db()
    assert row.first_token_at == first


def test_sweep_expires_only_queued_requests_past_their_deadline_oldest_first():
    overdue = [make_request(deadline_seconds=-10 + i) for i in range(3)]
    fresh = make_request(deadline_seconds=60)
    running = make_request(deadline_seconds=-20)
    now = timezone.now()
    lifecycle.claim([running.id], "w1", now - timedelta(seconds=30))  # claimed in time
    first = lifecycle.expire_overdue(now, limit=2)
    assert first.keys() == {overdue[0].id, overdue[1].id}
    assert first[overdue[0].id] == lifecycle.Ended(
        overdue[0].id, overdue[0].tenant_id, overdue[0].tier_id, "default.interactive",
        "expired", 50, was_waiting=True, timing=timing_of(overdue[0]),
    )  # fmt: skip
    assert lifecycle.expire_overdue(now).keys() == {overdue[2].id}
    assert lifecycle.expire_overdue(now) == {}
    statuses = dict(PromptRequest.objects.values_list("id", "status"))
    assert [statuses[r.id] for r in overdue] == [S.EXPIRED] * 3
    assert (statuses[fresh.id], statuses[running.id]) == (S.QUEUED, S.RUNNING)


def test_an_output_holding_nul_is_stored_with_the_replacement_character_and_spoils_no_batch():
    # PostgreSQL's text cannot hold NUL; the tiny random model generates it.
    odd, plain = make_request(), make_request()
    now = timezone.now()
    lifecycle.claim([odd.id, plain.id], "w1", now)
    won = lifecycle.finish([done(odd.id, 1, "a\x00b"), done(plain.id, 1, "fine")], now)
    assert won.keys() == {odd.id, plain.id}
    assert done(odd.id, 1, "a\x00b").output_text == "a\ufffdb"  # what the caller gets too
    odd.refresh_from_db()
    plain.refresh_from_db()
    assert (odd.status, odd.output_text) == (S.SUCCEEDED, "a\ufffdb")
    assert (plain.status, plain.output_text) == (S.SUCCEEDED, "fine")


@pytest.mark.django_db(transaction=True)
def test_the_recorder_reconnects_when_the_server_dropped_its_connection():
    """The recorder checks its connection once a second, not before every batch: a batch that
    meets a dropped connection runs again on a new one, and nothing is lost."""
    from django.db import connection

    from workers.recorder import Books, Recorder

    if connection.vendor != "postgresql":
        pytest.skip("only a database server can drop a connection (SQLite is a file)")
    published: list[Books] = []
    recorder = Recorder(published.append)
    first, second = make_request(), make_request()
    assert recorder.claim(first.id, "w1").result(timeout=10).attempt == 1
    with connection.cursor() as cursor:  # what a server restart does to the recorder's connection
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        [(terminated,)] = cursor.fetchall()
        assert terminated >= 1  # the recorder's (and any other test's idle one)
    assert recorder.claim(second.id, "w1").result(timeout=10).attempt == 1
    recorded = recorder.finish(done(second.id, 1)).result(timeout=10)
    assert (recorded.won, recorded.published) == (True, True)
    second.refresh_from_db()
    assert (second.status, second.attempts, second.output_text) == (S.SUCCEEDED, 1, "out")
    recorder.close()
    assert [str(second.id)] == [r[0] for b in published for r in b.results]


@pytest.mark.django_db(transaction=True)
def test_the_recorder_sends_an_outcome_before_its_event_lines_and_says_when_it_is_quiet():
    """A lone request's consumer waits for `wait_quiet` (workers/queue_order.py): it returns
    once everything submitted is recorded and sent. The event lines of a claim and a finish
    are written after the outcome went out, in the order they happened."""
    import json
    import logging
    import threading

    from contract import events
    from workers.recorder import Books, Recorded, Recorder

    lines: list[str] = []

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(json.loads(record.getMessage())["event"])

    gate, published = threading.Event(), []

    def publish(books: Books) -> None:
        if books.results:
            gate.wait(10)
            published.append(([r[0] for r in books.results], list(lines)))

    handler = Kept()
    logger = logging.getLogger(events.LOGGER)
    logger.addHandler(handler)
    recorder = Recorder(publish)
    try:
        row = make_request()
        claimed = recorder.claim(row.id, "w1")
        finished = recorder.finish(done(row.id, 1))  # the engine was done before the claim
        assert claimed.result(timeout=10).attempt == 1
        assert recorder.wait_quiet(0.2) is False  # the outcome is not sent yet
        assert not finished.done()
        gate.set()
        assert recorder.wait_quiet(10) is True
        assert finished.result(timeout=10) == Recorded(won=True, published=True)
        assert published == [([str(row.id)], [])]  # sent before any of its lines
        assert lines == ["dispatched", "finished"]
        assert recorder.wait_quiet(0) is True  # nothing submitted since
    finally:
        gate.set()
        recorder.close()
        logger.removeHandler(handler)
