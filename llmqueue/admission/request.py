"""Admitting one API request: its limits from the caller and route, the decision, the answer."""

from __future__ import annotations

import redis
from django.conf import settings

from contract import events
from llmqueue.admission.decision import (
    NO_WORKER,
    QUEUE_FULL,
    RATE,
    TENANT_SHARE,
    TOKENS,
    TOO_SLOW,
    Decision,
    Limits,
    admit,
)
from llmqueue.api.auth import Caller
from llmqueue.api.errors import ApiError, InvalidParameter, Overloaded, RateLimited, Unavailable
from llmqueue.api.validation import PromptSpec, wait_seconds
from llmqueue.invalidation import note_config_version
from llmqueue.queueing.lanes import queue_name
from llmqueue.queueing.routing import ModelRoute


def limits_for(caller: Caller, route: ModelRoute, spec: PromptSpec | None = None) -> Limits:
    return Limits(
        tenant_id=caller.tenant_id,
        tier_id=caller.tier_id,
        queue=queue_name(route.pool, caller.tier_name),
        pool=route.pool,
        requests_per_second=caller.requests_per_second,
        burst=caller.burst,
        tokens_per_minute=caller.tokens_per_minute,
        max_queue_depth=caller.max_queue_depth,
        max_tier_share=caller.max_tier_share,
        max_wait_seconds=caller.max_wait_seconds if spec is None else wait_seconds(spec, caller),
        own_deadline=spec is not None and spec.deadline_seconds is not None,
        first_token_target_seconds=(
            caller.first_token_target_seconds if settings.LLMQUEUE_SHED_AT_SLO else None
        ),
        wait_quantile=settings.LLMQUEUE_SHED_WAIT_QUANTILE,
    )


def tokens_needed(spec: PromptSpec) -> int:
    """What a request reserves against its tenant's tokens per minute until it finishes."""
    return int(spec.estimated_prompt_tokens + spec.params["max_tokens"])


def admit_request(
    caller: Caller,
    route: ModelRoute,
    spec: PromptSpec,
    now: float | None = None,
    request_id: str = "",
) -> int:
    """Admit a validated request or raise 429/503 (or 422 when it can never fit the tenant's
    tokens per minute); returns the tokens it reserved. Admitted, `request_id` counts in its
    queue's depth until its publish clears it (llmqueue/queueing/publishing.py)."""
    limits = limits_for(caller, route, spec)
    need = tokens_needed(spec)
    if need > limits.tokens_per_minute:
        raise InvalidParameter(
            f"The prompt (about {spec.estimated_prompt_tokens} tokens) plus max_tokens "
            f"({spec.params['max_tokens']}) exceeds tenant {caller.tenant_name!r}'s limit of "
            f"{limits.tokens_per_minute} tokens per minute.",
            code="tokens_per_minute_exceeded",
            param="max_tokens",
        )
    try:
        decision = admit(limits, need, now, request_id)
    except redis.RedisError as exc:  # nothing was stored or reserved yet: the caller retries
        raise Unavailable(
            "The queue is unavailable; retry shortly.",
            retry_after_seconds=settings.LLMQUEUE_UNKNOWN_WAIT_RETRY_SECONDS,
        ) from exc
    note_config_version(decision.config_version)
    if not decision.admitted:
        error = rejection(decision, limits, caller.tenant_name)
        fields = {
            "tenant_id": caller.tenant_id, "tenant": caller.tenant_name, "pool": limits.pool,
            "tier": caller.tier_name, "queue": limits.queue, "reason": decision.reason,
            "status": error.status, "retry_after_seconds": error.retry_after_seconds,
        }  # fmt: skip
        events.emit(events.REJECTED, fields)
        raise error
    return need


def rejection(decision: Decision, limits: Limits, tenant: str) -> ApiError:
    """The API error for a refused request: which limit, and when to retry."""
    retry = decision.retry_after_seconds
    if retry is None:
        retry = settings.LLMQUEUE_UNKNOWN_WAIT_RETRY_SECONDS
    if decision.reason == RATE:
        return RateLimited(
            f"Rate limit reached for requests: tenant {tenant!r} may send "
            f"{limits.requests_per_second:g} per second, in bursts of up to {limits.burst}.",
            error_type="requests",
            retry_after_seconds=retry,
        )
    if decision.reason == TOKENS:
        return RateLimited(
            f"Rate limit reached for tokens: tenant {tenant!r} may use "
            f"{limits.tokens_per_minute} tokens per minute (prompt + max_tokens are held until "
            "a request finishes).",
            error_type="tokens",
            retry_after_seconds=retry,
        )
    wait = ""
    if decision.drain_rate_per_second > 0:
        wait = f" (about {decision.ahead / decision.drain_rate_per_second:.0f} s of work ahead)"
    messages = {
        NO_WORKER: (f"No worker is serving queue {limits.queue!r} right now.", "no_worker"),
        QUEUE_FULL: (
            f"Queue {limits.queue!r} is full: {decision.ahead} requests waiting, limit "
            f"{limits.max_queue_depth}{wait}.",
            "queue_full",
        ),
        TOO_SLOW: (
            f"Queue {limits.queue!r} would likely not reach this request within its tier's "
            f"{limits.first_token_target_seconds:g} s first-token target: {decision.ahead} "
            f"requests due first{wait}, its wait to a first token estimated at "
            f"{decision.estimated_wait_seconds or 0:.2f} s (the {limits.wait_quantile:g} "
            "quantile).",
            "slo_unreachable",
        )
        if limits.sheds_at_target
        else (
            f"Queue {limits.queue!r} would not reach this request within its "
            f"{limits.max_wait_seconds:g} s deadline: {decision.ahead} requests waiting{wait}.",
            "deadline_unreachable",
        ),
        TENANT_SHARE: (
            f"Tenant {tenant!r} already fills its share ({limits.max_tier_share:.0%}) of queue "
            f"{limits.queue!r}.",
            "tenant_queue_share",
        ),
    }
    message, code = messages[decision.reason]
    return Overloaded(message, code=code, retry_after_seconds=retry)
