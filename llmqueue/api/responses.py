"""OpenAI-shaped response bodies for completions, chat, models, request status, files and
batches."""

from __future__ import annotations

from typing import Any

from llmqueue.models import BulkJob, PromptRequest, ServedModel, StoredFile

S = PromptRequest.Status


def _usage(result: dict[str, Any]) -> dict[str, int]:
    prompt, completion = result["prompt_tokens"] or 0, result["completion_tokens"] or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def completion_body(row: PromptRequest, result: dict[str, Any]) -> dict[str, Any]:
    """The body OpenAI returns for this request's kind, from a result dict (text, token counts,
    finish_reason)."""
    created = int(row.enqueued_at.timestamp())
    if row.kind == PromptRequest.Kind.CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": result["text"]},
            "finish_reason": result["finish_reason"],
            "logprobs": None,
        }
        return {
            "id": f"chatcmpl-{row.id}",
            "object": "chat.completion",
            "created": created,
            "model": row.model,
            "choices": [choice],
            "usage": _usage(result),
        }
    return {
        "id": f"cmpl-{row.id}",
        "object": "text_completion",
        "created": created,
        "model": row.model,
        "choices": [
            {
                "index": 0,
                "text": result["text"],
                "finish_reason": result["finish_reason"],
                "logprobs": None,
            }
        ],
        "usage": _usage(result),
    }


def _iso(value: Any) -> str | None:
    return value.isoformat() if value is not None else None


def request_body(row: PromptRequest) -> dict[str, Any]:
    """A request's status; `result` holds the completion body once it succeeded."""
    result = None
    if row.status == S.SUCCEEDED:
        result = completion_body(
            row,
            {
                "text": row.output_text,
                "prompt_tokens": row.prompt_tokens,
                "completion_tokens": row.completion_tokens,
                "finish_reason": row.finish_reason,
            },
        )
    return {
        "id": str(row.id),
        "object": "llmqueue.request",
        "status": row.status,
        "model": row.model,
        "kind": row.kind,
        "enqueued_at": _iso(row.enqueued_at),
        "deadline_at": _iso(row.deadline_at),
        "started_at": _iso(row.started_at),
        "finished_at": _iso(row.finished_at),
        "attempts": row.attempts,
        "result": result,
        "error": row.error or None,
    }


def models_body(models: list[ServedModel]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": m.name,
                "object": "model",
                "created": int(m.created_at.timestamp()),
                "owned_by": "llmqueue",
                "context_length": m.context_length,
                "max_tokens": m.max_tokens,
            }
            for m in models
        ],
    }


def _epoch(value: Any) -> int | None:
    return int(value.timestamp()) if value is not None else None


def file_body(stored: StoredFile) -> dict[str, Any]:
    return {
        "id": stored.id,
        "object": "file",
        "bytes": stored.bytes,
        "created_at": _epoch(stored.created_at),
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
        "status_details": None,
    }


def batch_body(job: BulkJob, counts: dict[str, int]) -> dict[str, Any]:
    """OpenAI's batch object; `counts` are its lines by status (failed: every line that ended
    without output, expired and cancelled ones too)."""
    done = sum(counts.get(s, 0) for s in (S.FAILED, S.EXPIRED, S.CANCELLED))
    return {
        "id": job.id,
        "object": "batch",
        "endpoint": job.endpoint,
        "model": job.model or None,
        "errors": {"object": "list", "data": job.errors} if job.errors else None,
        "input_file_id": job.input_file_id,
        "completion_window": job.completion_window,
        "status": job.status,
        "output_file_id": job.output_file_id,
        "error_file_id": job.error_file_id,
        "created_at": _epoch(job.created_at),
        "in_progress_at": _epoch(job.in_progress_at),
        "expires_at": _epoch(job.expires_at),
        "finalizing_at": _epoch(job.finalizing_at),
        "completed_at": _epoch(job.completed_at),
        "failed_at": _epoch(job.failed_at),
        "expired_at": _epoch(job.expired_at),
        "cancelling_at": _epoch(job.cancelling_at),
        "cancelled_at": _epoch(job.cancelled_at),
        "request_counts": {
            "total": job.total,
            "completed": counts.get(S.SUCCEEDED, 0),
            "failed": done,
        },
        "metadata": job.metadata,
    }


def list_body(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
