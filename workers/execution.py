"""Running one request on a worker: claim it, run it on the warm engine, record and publish once.

The stages run on the threads that own them, chained by future callbacks: the recorder thread
claims (DB), the engine thread generates, the recorder thread records and publishes. The chain
starts as the message is read (the worker's delivery hook, workers/prestart.py); the Celery
task's thread only takes it over and waits for its end, to ack the message, so no stage waits
for Celery's strategy or a task thread to wake up.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from celery.exceptions import Ignore, Reject

from contract.failures import (
    ContextLengthExceeded,
    GenerationError,
    ModelNotServed,
    RequestRejected,
)
from contract.task import TaskPayload
from llmqueue import lifecycle
from workers.batching import HandedBack
from workers.engine import Engine, EngineError, GenerationResult, PromptTooLong
from workers.engine_budget import NO_HOLD, Hold
from workers.prestart import start_generation, start_unless_overdue
from workers.recorder import Recorded, Recorder
from workers.served_models import ServedModels

if TYPE_CHECKING:  # workers/runtime.py builds on this module
    from workers.runtime import WorkerRuntime

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["run_prompts", "start_delivered", "start_prompt"]

Ran = tuple[lifecycle.Claim, lifecycle.Finish | None, Recorded | None]


def _then(source: Future[T], done: Future[Any], step: Callable[[T], None]) -> None:
    """Run `step(result)` when `source` completes, on the thread that completed it; any error
    (in `source` or in `step`) fails `done`, so the waiting task never hangs."""

    def callback(completed: Future[T]) -> None:
        try:
            step(completed.result())
        except BaseException as exc:
            if not done.done():
                done.set_exception(exc)

    source.add_done_callback(callback)


def outcome_of(
    request_id: uuid.UUID,
    attempt: int,
    generated: Future[GenerationResult],
    submitted_at: float | None = None,
) -> lifecycle.Finish:
    """The outcome to record for a generation; a failed one is recorded too, with why (the row
    says it, and the caller gets 413/400 when the request was at fault, 500 when the engine).
    `submitted_at` (epoch seconds the engine got it) dates the engine's lead to the first token."""
    try:
        result = generated.result()
    except EngineError as exc:
        code = (ContextLengthExceeded if isinstance(exc, PromptTooLong) else RequestRejected).code
        return lifecycle.Finish(
            request_id, attempt, succeeded=False, error=str(exc), error_code=code
        )
    except Exception as exc:
        error = f"engine failure: {type(exc).__name__}: {exc}"
        return lifecycle.Finish(
            request_id, attempt, succeeded=False, error=error, error_code=GenerationError.code
        )
    first_token = result.first_token_at
    lead = None
    if first_token is not None and submitted_at is not None:
        lead = max(0.0, first_token - submitted_at)
    return lifecycle.Finish(
        request_id,
        attempt,
        succeeded=True,
        output_text=result.text,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        finish_reason=result.finish_reason,
        first_token_at=None if first_token is None else datetime.fromtimestamp(first_token, UTC),
        engine_lead_seconds=lead,
    )


def not_served(request_id: uuid.UUID, attempt: int, refusal: str) -> lifecycle.Finish:
    """The failure recorded for a request routed to a worker that serves another model."""
    return lifecycle.Finish(
        request_id, attempt, succeeded=False, error=refusal, error_code=ModelNotServed.code
    )


def start_prompt(
    payload: TaskPayload,
    worker: str,
    recorder: Recorder,
    engine: Engine,
    served: ServedModels,
    hold: Hold = NO_HOLD,
    lane: str = "",
    redelivered: bool = False,
) -> Future[Ran]:
    """Claim → generate → record and publish, without blocking; the future holds the claim and,
    if it ran, the outcome and what became of it. `hold` (the request's place in the engine
    budget) is released when the chain ends; `lane` is the queue the request came from (the
    engine's admission parks a capped tier's requests by it).

    The engine gets the request while the claim is being recorded, not after: on a saturated
    engine the claim's DB round trip decides whether the first token comes a step later. A
    claim that loses (another attempt has the request, it was finished or revoked) aborts the
    generation. A request already past its deadline is only claimed, which expires it: nothing
    of it is generated. Nor is a request for a model the worker does not serve (`served`): it
    is claimed and recorded failed (ModelNotServed), so its caller learns the routing is wrong
    and its reservation comes back as for any failure. A `redelivered` request reaches the
    engine only once claimed: its claim fails it if it is poison (it killed
    LLMQUEUE_MAX_WORKER_LOSSES workers), before it can kill this one."""
    request_id = uuid.UUID(payload["request_id"])
    done: Future[Ran] = Future()
    refusal = served.refusal(payload["model"])
    # A redelivered request may be the one that killed the worker before: it waits for its
    # claim, which fails it instead once it killed LLMQUEUE_MAX_WORKER_LOSSES of them.
    early = refusal is None and not redelivered
    started = start_unless_overdue(engine, payload, lane) if early else None

    def record(claim: lifecycle.Claim, outcome: lifecycle.Finish) -> None:
        _then(recorder.finish(outcome), done, lambda r: done.set_result((claim, outcome, r)))

    def on_claim(claim: lifecycle.Claim) -> None:
        if claim.expired or claim.attempt is None:
            if started is not None:
                engine.abort(started.engine_id)
            done.set_result((claim, None, None))
            return
        attempt = claim.attempt
        if refusal is not None:
            record(claim, not_served(request_id, attempt, refusal))
            return
        # Overdue by this host's clock yet claimed (clocks differ): it runs all the same.
        generation = started or start_generation(engine, payload, lane)

        def on_generated(generated: Future[GenerationResult]) -> None:
            handed_back = generated.exception()
            if isinstance(handed_back, HandedBack):
                # The worker is stopping: no outcome is recorded, the row goes back to queued
                # (no lost worker for the next claim to count) before the message is requeued.
                returned = recorder.hand_back(request_id, attempt)
                returned.add_done_callback(lambda _: done.set_exception(handed_back))
                return
            try:
                record(claim, outcome_of(request_id, attempt, generated, generation.submitted_at))
            except BaseException as exc:
                done.set_exception(exc)

        generation.future.add_done_callback(on_generated)

    def on_claim_failed(failed: Future[lifecycle.Claim]) -> None:
        if failed.exception() is not None and started is not None:
            engine.abort(started.engine_id)  # nobody will record what it generates

    claimed = recorder.claim(request_id, worker)
    claimed.add_done_callback(on_claim_failed)
    _then(claimed, done, on_claim)
    # Its place goes back once its row says it is finished (or it was not run): a tier's unfinished
    # rows on this worker then never exceed its cap, as the DB shows, at the cost of the recorder's
    # few milliseconds per request.
    done.add_done_callback(lambda _: hold.release())
    return done


def start_delivered(
    worker: str,
    recorder: Recorder,
    engine: Engine,
    served: ServedModels,
    payload: TaskPayload,
    lane: str,
    hold: Hold,
    redelivered: bool,
) -> Future[Ran]:
    """The worker's delivery hook's starter (workers.prestart.Starter): `start_prompt` for a
    request as its message is read from queue `lane` (`redelivered`: restored by kombu or a
    rescue, so its previous worker may have died of it)."""
    return start_prompt(payload, worker, recorder, engine, served, hold, lane, redelivered)


def run_prompts(runtime: WorkerRuntime, payloads: list[TaskPayload]) -> None:
    """Run the requests of one task message (one for an API call, several for a bulk job's
    chunk) on the engine at once, or take over the chains the delivery hook started for them;
    each outcome is published by the recorder.

    Raises Ignore when this delivery did nothing to publish (the requests were already finished,
    or another attempt took them over), only expiries (the recorder published those: their
    deadline passed before the engine got them) or only refusals of a model the worker does
    not serve (published too, and the worker warned once per model, not an ERROR per request),
    and GenerationError when the engine failed a request (so Celery logs and counts a failure;
    the others' results are published all the same).
    """
    recorder, engine, worker = runtime.recorder, runtime.engine, runtime.node
    served = runtime.served
    holds = runtime.take_holds([payload["request_id"] for payload in payloads])
    try:
        chains = [
            runtime.take_prestart(payload["request_id"])
            or start_prompt(payload, worker, recorder, engine, served, hold)
            for payload, hold in zip(payloads, holds, strict=True)
        ]
        ran = [chain.result() for chain in chains]
    except HandedBack:
        # The worker is stopping (workers/runtime.py, WorkerRuntime.stop_gracefully): the
        # message goes back to its queue's head at once; the requests of it that finished are
        # dropped when redelivered (their claim finds them finished), the others run again.
        raise Reject("handed back: the worker is stopping", requeue=True) from None
    finally:  # whatever failed on the way, the budget gets its places back (release is once)
        for hold in holds:
            hold.release()
    recorded = [(claim, outcome, r) for claim, outcome, r in ran if outcome and r and r.won]
    if not recorded:
        raise Ignore()
    for claim, _, r in recorded:
        if not r.published:
            log.warning(
                "request %s finished but its result could not be published", claim.request_id
            )
    refused = [o for _, o, _ in recorded if o.error_code == ModelNotServed.code]
    failed = [o for _, o, _ in recorded if not o.succeeded and o.error_code != ModelNotServed.code]
    if failed:
        raise GenerationError("; ".join(f"{o.request_id}: {o.error}" for o in failed))
    if len(refused) == len(recorded):
        raise Ignore()
