"""Why a request failed, as the worker records and publishes it and the API answers it.

The result backend carries an exception's type name and message; the API maps the name back to
an HTTP status (llmqueue/api/views.py), so the caller learns whether to fix the request or retry.
"""

from __future__ import annotations


class GenerationError(Exception):
    """The engine failed the request (not the request's fault): 500."""

    code = "generation_failed"


class RequestRejected(GenerationError):
    """The engine refused the request as invalid (the caller's fault): 400."""

    code = "invalid_request"


class ContextLengthExceeded(RequestRejected):
    """The prompt (with max_tokens) does not fit the model's context, counted exactly by the
    engine's tokenizer where the API could only estimate: 413."""

    code = "context_length_exceeded"


class RequestCancelled(GenerationError):
    """The request was cancelled (POST /v1/requests/{id}/cancel) before it finished: 409."""

    code = "request_cancelled"


class ModelNotServed(GenerationError):
    """The request reached a worker that does not serve its model (a served model mapped to the
    wrong pool, a worker started with the wrong --model): the operator's routing, not the
    caller's request, is at fault, and nothing was generated, so a retry is safe once routing is
    fixed or another worker of the pool serves the model: 503."""

    code = "model_not_served"


class PoisonRequest(GenerationError):
    """Every worker that ran the request died holding it (LLMQUEUE_MAX_WORKER_LOSSES of them):
    it is failed rather than redelivered to kill the next one. The engine's fault, or the
    request's, but not one a retry of the same request would escape: 500."""

    code = "worker_lost_repeatedly"


FAILURES: dict[str, type[GenerationError]] = {
    cls.code: cls
    for cls in (
        GenerationError,
        RequestRejected,
        ContextLengthExceeded,
        RequestCancelled,
        ModelNotServed,
        PoisonRequest,
    )
}
