"""HTTP views of the OpenAI-compatible API: thin, they call auth, validation, submission."""

from __future__ import annotations

import contextlib
import functools
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery import states
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt

from llmqueue.admission.request import admit_request
from llmqueue.api import idempotency, validation
from llmqueue.api.auth import Caller, authenticate
from llmqueue.api.body import read_body
from llmqueue.api.errors import (
    ApiError,
    GenerationFailed,
    MethodNotAllowed,
    NotFound,
    RequestExpired,
    Unavailable,
    WaitTimeout,
    error_response,
    failure_error,
    is_client_error,
    request_error,
    unknown_endpoint,
)
from llmqueue.api.openapi import openapi_document
from llmqueue.api.responses import completion_body, models_body, request_body
from llmqueue.api.results import Outcome, wait_for_outcome
from llmqueue.api.tiers import TIER_HEADER, caller_on_tier
from llmqueue.api.url_text import check_url_text
from llmqueue.api.validation import wait_seconds
from llmqueue.cancellation import cancel_requests
from llmqueue.metrics.api_errors import count_api_error
from llmqueue.models import PromptRequest
from llmqueue.queueing.routing import ModelRoute, live_models, resolve_model
from llmqueue.queueing.submission import submit_prompt

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "X-LLMQueue-Request-Id"
BACKGROUND_HEADER = "X-LLMQueue-Background"
DEADLINE_HEADER = "X-LLMQueue-Deadline-Seconds"
# How long the request waited between admission and a worker's claim, in seconds.
QUEUE_SECONDS_HEADER = "X-LLMQueue-Queue-Seconds"
# On an answer to a send under an Idempotency-Key already used: the first send's request.
REPLAYED_HEADER = "Idempotent-Replayed"

# Headers that change what a prompt request is: part of its idempotency fingerprint.
REQUEST_HEADERS = (TIER_HEADER, BACKGROUND_HEADER, DEADLINE_HEADER)

View = Callable[..., HttpResponse]


def api_endpoint(*methods: str) -> Callable[[View], View]:
    """Accept only `methods` (none given: any); turn every ApiError, every malformed request
    Django refuses, and any crash into an OpenAI-shaped error."""

    def decorate(view: View) -> View:
        @csrf_exempt
        @functools.wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            try:
                if methods and request.method not in methods:
                    raise MethodNotAllowed(
                        f"Use {' or '.join(methods)} for this endpoint.",
                        headers={"Allow": ", ".join(methods)},
                    )
                check_url_text(request)
                return view(request, *args, **kwargs)
            except Exception as exc:
                error = exc if isinstance(exc, ApiError) else request_error(exc)
                if error is None:
                    log.exception("unhandled error in %s", view.__name__)
                    error = GenerationFailed("Internal error.", code="internal_error")
                elif is_client_error(error):
                    count_api_error(error.code)
                return error_response(error)

        return wrapped

    return decorate


def _respond_with_outcome(
    row: PromptRequest, outcome: Outcome | None, waited: float, headers: dict[str, str]
) -> HttpResponse:
    poll = f"/v1/requests/{row.id}"
    if outcome is None:
        raise WaitTimeout(
            f"No result within {waited:g} s; request {row.id} stays queued: poll GET {poll}.",
            headers=headers,
        )
    if outcome.state == states.SUCCESS and outcome.result is not None:
        queued = outcome.result.get("queue_seconds")
        if queued is not None:
            headers[QUEUE_SECONDS_HEADER] = f"{queued:.3f}"
        return JsonResponse(completion_body(row, outcome.result), headers=headers)
    if outcome.state == states.REVOKED:
        raise RequestExpired(
            f"Request {row.id} expired: its deadline passed before an engine took it.",
            headers=headers,
        )
    raise failure_error(outcome.error_type, outcome.error_message, headers)


def _answer(
    row: PromptRequest, spec: validation.PromptSpec, caller: Caller, replayed: bool = False
) -> HttpResponse:
    """202 with the request's status (background), or its outcome once it has one."""
    headers = {REQUEST_ID_HEADER: str(row.id)}
    if replayed:
        headers[REPLAYED_HEADER] = "true"
    if spec.background:
        return JsonResponse(request_body(row), status=202, headers=headers)
    if replayed and row.status == PromptRequest.Status.SUCCEEDED:
        return JsonResponse(request_body(row)["result"], headers=headers)
    try:
        outcome = wait_for_outcome(str(row.id), wait_seconds(spec, caller))
    except redis.RedisError as exc:  # the request is queued: say which, so it can be polled
        raise Unavailable(
            f"Lost the queue while waiting for request {row.id}; it stays queued: "
            f"poll GET /v1/requests/{row.id}.",
            retry_after_seconds=5,
            headers=headers,
        ) from exc
    return _respond_with_outcome(row, outcome, wait_seconds(spec, caller), headers)


def _admit_and_submit(
    caller: Caller, route: ModelRoute, spec: validation.PromptSpec, request_id: uuid.UUID
) -> PromptRequest:
    # The id comes first: the queue's depth counts it from admission until its publish.
    reserved = admit_request(caller, route, spec, request_id=str(request_id))
    return submit_prompt(caller, route, spec, reserved_tokens=reserved, request_id=request_id)


def _first_request(first_id: uuid.UUID, caller: Caller) -> PromptRequest:
    row = PromptRequest.objects.filter(pk=first_id, tenant_id=caller.tenant_id).first()
    if row is None:  # the first send is between its key and its row's INSERT
        raise idempotency.KeyInUse(
            f"The request sent with this {idempotency.HEADER} is still being admitted; "
            "retry shortly.",
            retry_after_seconds=1,
        )
    return row


def _serve_prompt(
    request: HttpRequest, parse: Callable[..., validation.PromptSpec]
) -> HttpResponse:
    body = validation.parse_json_object(read_body(request))
    caller: Caller = caller_on_tier(
        lambda fresh: authenticate(request, fresh),
        body.get("service_tier"),
        request.headers.get(TIER_HEADER),
    )
    route = resolve_model(validation.model_name(body))
    spec = parse(
        body,
        caller,
        route,
        request.headers.get(BACKGROUND_HEADER),
        request.headers.get(DEADLINE_HEADER),
    )
    key = idempotency.checked_key(request.headers.get(idempotency.HEADER))
    request_id = uuid.uuid4()
    if key is None:
        return _answer(_admit_and_submit(caller, route, spec, request_id), spec, caller)
    sent_with = {name: request.headers.get(name) for name in REQUEST_HEADERS}
    print_ = idempotency.fingerprint(body, sent_with)
    try:
        first = idempotency.reserve(caller.tenant_id, key, request_id, print_)
    except redis.RedisError as exc:
        raise Unavailable(
            "The queue is unavailable; retry shortly.", retry_after_seconds=5
        ) from exc
    if first is not None:
        return _answer(_first_request(first, caller), spec, caller, replayed=True)
    try:
        row = _admit_and_submit(caller, route, spec, request_id)
    except Exception:
        # Refused or never queued: the same key sent again is a new try, as the refusal asks.
        with contextlib.suppress(redis.RedisError):
            idempotency.release(caller.tenant_id, key, request_id, print_)
        raise
    return _answer(row, spec, caller)


@api_endpoint("POST")
def completions(request: HttpRequest) -> HttpResponse:
    return _serve_prompt(request, validation.parse_completion)


@api_endpoint("POST")
def chat_completions(request: HttpRequest) -> HttpResponse:
    return _serve_prompt(request, validation.parse_chat)


@api_endpoint("GET")
def models(request: HttpRequest) -> HttpResponse:
    authenticate(request)
    return JsonResponse(models_body(live_models()))


def _own_request(request: HttpRequest, request_id: str) -> PromptRequest:
    caller = authenticate(request)
    try:
        key = uuid.UUID(request_id)
    except ValueError:
        key = None
    row = PromptRequest.objects.filter(pk=key, tenant_id=caller.tenant_id).first() if key else None
    if row is None:  # another tenant's request is as unknown as a missing one
        raise NotFound(f"No request {request_id!r} for this API key.", code="request_not_found")
    return row


@api_endpoint("GET")
def request_status(request: HttpRequest, request_id: str) -> HttpResponse:
    row = _own_request(request, request_id)
    headers = {}
    if row.started_at is not None:
        queued = max(0.0, (row.started_at - row.enqueued_at).total_seconds())
        headers[QUEUE_SECONDS_HEADER] = f"{queued:.3f}"
    return JsonResponse(request_body(row), headers=headers)


@api_endpoint("POST")
def cancel_request(request: HttpRequest, request_id: str) -> HttpResponse:
    """Cancel a queued or running request; a finished one is answered as it is (its output is
    kept). The status body either way."""
    row = _own_request(request, request_id)
    try:
        cancel_requests([row.id])
    except redis.RedisError:  # the row is cancelled: callers and workers learn it from the DB
        log.warning("request %s cancelled, but Redis could not be told", row.id)
    row.refresh_from_db()
    return JsonResponse(request_body(row))


@api_endpoint()
def unknown_route(request: HttpRequest, path: str) -> HttpResponse:
    """Every /v1/ path no endpoint serves: a JSON 404, as OpenAI answers, not Django's page."""
    raise unknown_endpoint(request.method, request.path)


@api_endpoint("GET")
def openapi(request: HttpRequest) -> HttpResponse:
    """The API's OpenAPI document, generated from its request models; no key needed."""
    return JsonResponse(openapi_document())
