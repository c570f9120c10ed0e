"""Typed API errors, each carrying its HTTP status and Retry-After, and their one JSON rendering."""

from __future__ import annotations

import math

from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import JsonResponse, UnreadablePostError
from django.http.multipartparser import MultiPartParserError

from contract.failures import (
    ContextLengthExceeded,
    ModelNotServed,
    PoisonRequest,
    RequestCancelled,
    RequestRejected,
)


class ApiError(Exception):
    """An error the API reports to the caller in OpenAI's error shape."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        error_type: str | None = None,
        param: str | None = None,
        retry_after_seconds: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if error_type is not None:
            self.type = error_type
        self.param = param
        self.retry_after_seconds = retry_after_seconds
        self.headers = headers or {}
        # An outcome a worker recorded (a 409 cancelled, a 413 found by the tokenizer) is
        # counted with the request's outcome, not again as a refusal.
        self.from_outcome = False


class BadRequest(ApiError):
    status = 400
    code = "invalid_request"


class InvalidParameter(ApiError):
    """The body parsed, but a value is out of range or beyond a limit."""

    status = 422
    code = "invalid_parameter"


class Unauthenticated(ApiError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ApiError):
    status = 403
    type = "permission_error"
    code = "tenant_inactive"


class NotFound(ApiError):
    status = 404
    code = "not_found"


def unknown_endpoint(method: str | None, path: str) -> NotFound:
    return NotFound(f"Unknown endpoint: {method} {path}.", code="unknown_url")


class MethodNotAllowed(ApiError):
    status = 405
    code = "method_not_allowed"


class PromptTooLarge(ApiError):
    status = 413
    code = "context_length_exceeded"


class RateLimited(ApiError):
    """The tenant is over a rate limit; `type` names which (OpenAI: "requests" or "tokens")."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class Unavailable(ApiError):
    status = 503
    type = "server_error"
    code = "unavailable"


class Overloaded(Unavailable):
    """Backpressure: the queue cannot take the request now (its code says why)."""

    code = "queue_full"


class Misrouted(Unavailable):
    """The worker the request was routed to serves another model: an operator's routing mistake
    (a served model on the wrong pool, a worker's wrong --model), not the caller's. Nothing was
    generated, so the request may be sent again; no Retry-After, since only the routing's fix
    (or another worker of the pool) makes it succeed."""

    code = ModelNotServed.code


class GenerationFailed(ApiError):
    status = 500
    type = "server_error"
    code = "generation_failed"


class WorkerLostRepeatedly(GenerationFailed):
    """Every worker that ran the request died holding it (LLMQUEUE_MAX_WORKER_LOSSES): it was
    failed rather than sent to the next worker to kill."""

    code = PoisonRequest.code


class WaitTimeout(ApiError):
    """The blocking wait ran out; the request stays queued and can be polled."""

    status = 504
    type = "timeout"
    code = "wait_timeout"


class Cancelled(ApiError):
    """The request was cancelled before it finished; nothing more of it is generated."""

    status = 409
    type = "invalid_request_error"
    code = "request_cancelled"


class RequestExpired(ApiError):
    """The request's deadline passed before an engine took it; it was never generated."""

    status = 504
    type = "timeout"
    code = "expired"


def failure_error(error_type: str, message: str, headers: dict[str, str]) -> ApiError:
    """The API error for a failure a worker published (contract/failures.py), by its type name:
    the request's fault is a 4xx the caller can fix, the engine's a 500, the routing's a 503."""
    error: ApiError
    if error_type == ContextLengthExceeded.__name__:
        error = PromptTooLarge(message, headers=headers)
    elif error_type == RequestCancelled.__name__:
        error = Cancelled(message, headers=headers)
    elif error_type == RequestRejected.__name__:
        error = BadRequest(message, code=RequestRejected.code, headers=headers)
    elif error_type == ModelNotServed.__name__:
        error = Misrouted(message, headers=headers)
    elif error_type == PoisonRequest.__name__:
        error = WorkerLostRepeatedly(message, headers=headers)
    else:
        error = GenerationFailed(f"Generation failed: {message}", headers=headers)
    error.from_outcome = True
    return error


def is_client_error(error: ApiError) -> bool:
    """A refusal of the request as sent (4xx) that admission's script did not count (its 429s
    and 503s) and that is not a recorded outcome: what llmqueue_api_errors counts."""
    return (
        400 <= error.status < 500 and error.status != RateLimited.status and not error.from_outcome
    )


def error_response(error: ApiError) -> JsonResponse:
    """Render an ApiError as OpenAI's error body, with Retry-After when it has one."""
    # OpenAI's shape has all four keys, `param` null when no one field is at fault.
    body = {
        "error": {
            "message": error.message,
            "type": error.type,
            "param": error.param,
            "code": error.code,
        }
    }
    response = JsonResponse(body, status=error.status)
    if error.retry_after_seconds is not None:
        response["Retry-After"] = str(max(1, math.ceil(error.retry_after_seconds)))
    for name, value in error.headers.items():
        response[name] = value
    # An ApiError is an answer, not a fault: django.request would log each one (a line per 429
    # and an ERROR per backpressure 503, ~5% of a rejection's CPU under load); usage counts them
    # by reason instead. Crashes are still logged where they are caught (views.api_endpoint).
    response._has_been_logged = True
    return response


class PayloadTooLarge(ApiError):
    """An upload beyond the file size limit (LLMQUEUE_BULK_MAX_FILE_BYTES)."""

    status = 413
    code = "file_too_large"


class RequestTooLarge(ApiError):
    """A request body beyond LLMQUEUE_MAX_BODY_BYTES, refused before it is read or parsed."""

    status = 413
    code = "request_too_large"


def request_error(exc: Exception) -> ApiError | None:
    """The API error for what Django raises on a malformed request (an oversized or broken body,
    too many form fields, a suspicious upload): the caller's fault, a 4xx. None: a crash."""
    if isinstance(exc, RequestDataTooBig):
        return RequestTooLarge(str(exc) or "The request body is too large.")
    if isinstance(exc, SuspiciousOperation | MultiPartParserError | UnreadablePostError):
        return BadRequest(f"The request could not be read: {exc}.", code="invalid_request")
    return None


class Conflict(ApiError):
    """The object is in a state that does not allow the call (a finished batch's cancel)."""

    status = 409
    code = "invalid_state"
