"""How a failed generation is classified on the worker and answered by the API."""

from __future__ import annotations

import uuid
from concurrent.futures import Future

from contract.failures import (
    ContextLengthExceeded,
    GenerationError,
    ModelNotServed,
    RequestRejected,
)
from llmqueue import lifecycle
from llmqueue.api.errors import (
    BadRequest,
    GenerationFailed,
    Misrouted,
    PromptTooLarge,
    failure_error,
)
from workers.engine import EngineError, GenerationResult, PromptTooLong
from workers.execution import outcome_of
from workers.recorder import result_of

RID = uuid.UUID(int=7)


def failed_with(exc: BaseException) -> lifecycle.Finish:
    future: Future[GenerationResult] = Future()
    future.set_exception(exc)
    return outcome_of(RID, 2, future)


def test_engine_rejections_and_failures_are_recorded_with_their_kind():
    too_long = failed_with(PromptTooLong("maximum context length is 2048 tokens"))
    assert (too_long.succeeded, too_long.attempt) == (False, 2)
    assert (too_long.error_code, too_long.error) == (
        "context_length_exceeded",
        "maximum context length is 2048 tokens",
    )
    assert failed_with(EngineError("bad stop")).error_code == "invalid_request"
    crashed = failed_with(RuntimeError("engine closed"))
    assert crashed.error_code == "generation_failed"
    assert crashed.error == "engine failure: RuntimeError: engine closed"


def test_published_failure_carries_its_kind_as_the_exception_type():
    for code, kind in (
        ("context_length_exceeded", ContextLengthExceeded),
        ("invalid_request", RequestRejected),
        ("generation_failed", GenerationError),
        ("model_not_served", ModelNotServed),
        ("", GenerationError),  # rows recorded before kinds existed
    ):
        exc, state = result_of(lifecycle.Finish(RID, 1, False, error="why", error_code=code))
        assert (type(exc), exc.args, state) == (kind, ("why",), "FAILURE")


def test_api_answers_the_requests_fault_with_4xx_and_the_engines_with_500():
    headers = {"X-LLMQueue-Request-Id": str(RID)}
    too_long = failure_error("ContextLengthExceeded", "too long", headers)
    assert (type(too_long), too_long.status, too_long.code) == (
        PromptTooLarge, 413, "context_length_exceeded",
    )  # fmt: skip
    rejected = failure_error("RequestRejected", "bad stop", headers)
    assert (type(rejected), rejected.status, rejected.code) == (BadRequest, 400, "invalid_request")
    crashed = failure_error("GenerationError", "engine closed", headers)
    assert (type(crashed), crashed.status, crashed.message) == (
        GenerationFailed, 500, "Generation failed: engine closed",
    )  # fmt: skip
    assert crashed.headers == headers


def test_api_answers_a_request_routed_to_a_worker_of_another_model_with_503():
    # The operator's routing is at fault, not the request, and nothing was generated: a 5xx
    # the caller may retry, without a Retry-After, since only fixing the routing helps.
    why = "pool 'p' worker w serves model 'a', not 'b': check ServedModel routing / …"
    misrouted = failure_error("ModelNotServed", why, {})
    assert (type(misrouted), misrouted.status, misrouted.type, misrouted.code) == (
        Misrouted, 503, "server_error", "model_not_served",
    )  # fmt: skip
    assert (misrouted.message, misrouted.retry_after_seconds) == (why, None)
    assert misrouted.from_outcome  # counted with the request's outcome, not as a refusal


def test_a_published_failure_reaches_the_waiting_api_with_its_kind(clean_redis):
    from celery import states

    from llmqueue.api.results import Outcome, wait_for_outcome
    from project.celery import app

    app.backend.store_many([("f-1", ContextLengthExceeded("2049 > 2048 tokens"), states.FAILURE)])
    assert wait_for_outcome("f-1", 5) == Outcome(
        states.FAILURE, None, "ContextLengthExceeded", "2049 > 2048 tokens"
    )


def test_a_waiting_thread_stays_on_its_last_channel_only_and_ignores_its_late_messages(clean_redis):
    """The API leaves a result's channel at the thread's next wait, not between the outcome
    and the response (llmqueue/api/results.py): one channel stays subscribed per thread, and a
    duplicate published there later is not taken for the next request's outcome."""
    import threading

    from celery import states

    from llmqueue.api.results import Outcome, wait_for_outcome
    from project.celery import app

    def channel(task_id: str) -> str:
        return app.backend.get_key_for_task(task_id).decode()

    app.backend.store_many([("a-1", {"text": "a"}, states.SUCCESS)])
    assert wait_for_outcome("a-1", 5) == Outcome(states.SUCCESS, {"text": "a"})
    assert clean_redis.pubsub_numsub(channel("a-1")) == [(channel("a-1").encode(), 1)]
    app.backend.store_many([("a-1", {"text": "late"}, states.SUCCESS)])  # a duplicate, later
    # b-1's outcome comes while the thread waits for it, behind a-1's late message.
    later = threading.Timer(0.2, app.backend.store_many, [[("b-1", {"text": "b"}, states.SUCCESS)]])
    later.start()
    assert wait_for_outcome("b-1", 5) == Outcome(states.SUCCESS, {"text": "b"})
    later.join()
    assert clean_redis.pubsub_numsub(channel("a-1"), channel("b-1")) == [
        (channel("a-1").encode(), 0),
        (channel("b-1").encode(), 1),
    ]


def test_books_that_fail_after_their_results_went_out_leave_the_results_published(
    clean_redis, monkeypatch, caplog
):
    """The recorder sends a batch's results first and its books after (workers/recorder.py): a
    refused settlement is logged, and the caller still has its result."""
    import logging

    import redis
    from celery import states

    from contract.keys import USAGE_PREFIX
    from llmqueue import accounting
    from llmqueue.api.results import Outcome, wait_for_outcome
    from llmqueue.lifecycle import Ended
    from workers.recorder import Books, send_books

    def refused(pipe: object, ended: object, now: object = None) -> None:
        raise redis.ResponseError("OOM command not allowed when used memory > 'maxmemory'")

    monkeypatch.setattr(accounting, "settle", refused)
    ended = Ended(uuid.UUID(int=1), 1, 1, "default.interactive", "succeeded", 10, 2, 3)
    with caplog.at_level(logging.ERROR, logger="workers.recorder"):
        send_books(Books([("r-1", {"text": "hi"}, states.SUCCESS)], [ended]))
    assert wait_for_outcome("r-1", 5) == Outcome(states.SUCCESS, {"text": "hi"})
    [record] = [r for r in caplog.records if r.name == "workers.recorder"]
    assert record.getMessage() == (
        "settling 1 ended requests and 0 claims failed after their results were sent"
    )
    assert clean_redis.keys(f"{USAGE_PREFIX}:*") == []  # nothing of the books was sent
