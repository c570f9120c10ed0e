"""Running one request on a worker: claim it, run it on the warm engine, record and publish once."""

from __future__ import annotations

import uuid
from typing import Any

from celery.exceptions import Ignore

from llmqueue import lifecycle
from llmqueue.payload import TaskPayload
from llmqueue.recorder import get_recorder
from workers.engine import EngineError, generation_request
from workers.runtime import current_engine


class GenerationError(Exception):
    """The engine rejected or failed the request; the caller sees the message."""


def run_prompt(payload: TaskPayload, worker: str, mark_expired: Any) -> dict[str, Any]:
    """Run the request in `payload` and return the result the backend stores.

    Raises Ignore when this delivery must not publish anything: the request is already finished,
    or another attempt took it over. `mark_expired(request_id)` publishes the expiry instead of a
    result when the deadline passed before the engine got the request.
    """
    request_id = uuid.UUID(payload["request_id"])
    recorder = get_recorder()
    claim = recorder.claim(request_id, worker)
    if claim.expired:
        mark_expired(payload["request_id"])
        raise Ignore()
    if claim.attempt is None:
        raise Ignore()
    request = generation_request(
        f"{request_id}:{claim.attempt}",
        payload["prompt"],
        payload["messages"],
        payload["params"],
        payload["priority"],
    )
    try:
        result = current_engine().submit(request).result()
    except EngineError as exc:
        failure = lifecycle.Finish(request_id, claim.attempt, succeeded=False, error=str(exc))
        if recorder.finish(failure):
            raise GenerationError(str(exc)) from exc
        raise Ignore() from exc
    outcome = lifecycle.Finish(
        request_id,
        claim.attempt,
        succeeded=True,
        output_text=result.text,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        finish_reason=result.finish_reason,
    )
    if not recorder.finish(outcome):
        raise Ignore()
    return {
        "text": result.text,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "finish_reason": result.finish_reason,
    }
