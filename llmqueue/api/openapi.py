"""The OpenAPI document of /v1/ (GET /v1/openapi.json); its schemas come from request_models.py."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from llmqueue.api.request_models import (
    BatchRequest,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorBody,
    FileUpload,
)

REF = "#/components/schemas/{model}"
OPENAPI_VERSION = "3.1.0"  # JSON Schema 2020-12, the dialect pydantic writes


def _header(name: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": False, "description": description,
            "schema": {"type": "string"}}  # fmt: skip


def _path_id(name: str, **schema: Any) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string", **schema}}


def _query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema}


PROMPT_HEADERS = (
    _header("X-LLMQueue-Background", "true: answer 202 at once; poll GET /v1/requests/{id}."),
    _header("X-LLMQueue-Deadline-Seconds", "A tighter deadline, in seconds (a number)."),
    _header("X-LLMQueue-Tier", "The tier to run on, one the tenant may use."),
    _header(
        "Idempotency-Key",
        "1-255 characters: sent again with the same request, it answers the first send's "
        "request (Idempotent-Replayed: true) instead of generating again; 24 h.",
    ),
)
PAGE = (_query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
        _query("after", {"type": "string"}))  # fmt: skip


@dataclass(frozen=True)
class Operation:
    """One method on one path, as the document describes it."""

    method: str
    path: str  # an OpenAPI path template, /v1/files/{file_id}
    summary: str
    body: type[BaseModel] | None = None
    media_type: str = "application/json"
    parameters: tuple[dict[str, Any], ...] = ()
    success: tuple[int, ...] = (200,)
    public: bool = False  # no API key needed


REQUEST_ID = _path_id("request_id", format="uuid")
FILE_ID = _path_id("file_id")
BATCH_ID = _path_id("batch_id")
OPERATIONS = (
    Operation("post", "/v1/completions", "Complete a prompt", CompletionRequest,
              parameters=PROMPT_HEADERS, success=(200, 202)),
    Operation("post", "/v1/chat/completions", "Complete a chat", ChatCompletionRequest,
              parameters=PROMPT_HEADERS, success=(200, 202)),
    Operation("get", "/v1/models", "Models with a live worker"),
    Operation("get", "/v1/requests/{request_id}", "A request's status", parameters=(REQUEST_ID,)),
    Operation("post", "/v1/requests/{request_id}/cancel", "Cancel a request",
              parameters=(REQUEST_ID,)),
    Operation("get", "/v1/files", "The tenant's files",
              parameters=(*PAGE, _query("purpose", {"type": "string"}))),
    Operation("post", "/v1/files", "Upload a batch input file", FileUpload,
              media_type="multipart/form-data"),
    Operation("get", "/v1/files/{file_id}", "A file", parameters=(FILE_ID,)),
    Operation("delete", "/v1/files/{file_id}", "Delete a file", parameters=(FILE_ID,)),
    Operation("get", "/v1/files/{file_id}/content", "A file's content", parameters=(FILE_ID,)),
    Operation("get", "/v1/batches", "The tenant's batches, newest first", parameters=PAGE),
    Operation("post", "/v1/batches", "Create a batch from an uploaded file", BatchRequest,
              parameters=(PROMPT_HEADERS[2],)),
    Operation("get", "/v1/batches/{batch_id}", "A batch", parameters=(BATCH_ID,)),
    Operation("post", "/v1/batches/{batch_id}/cancel", "Cancel a batch", parameters=(BATCH_ID,)),
    Operation("get", "/v1/openapi.json", "This document", public=True),
)  # fmt: skip
ERROR = {"$ref": REF.format(model="ErrorBody")}


def _operation(op: Operation, refs: dict[type[BaseModel], dict[str, Any]]) -> dict[str, Any]:
    described: dict[str, Any] = {
        "summary": op.summary,
        "operationId": f"{op.method}{op.path.replace('/', '_').replace('{', '').replace('}', '')}",
        "parameters": list(op.parameters),
        "responses": {
            **{str(code): {"description": "Success", "content": {"application/json": {
                "schema": {"type": "object"}}}} for code in op.success},
            "default": {"description": "An error, OpenAI's shape",
                        "content": {"application/json": {"schema": ERROR}}},
        },
    }  # fmt: skip
    if op.body is not None:
        described["requestBody"] = {
            "required": True,
            "content": {op.media_type: {"schema": refs[op.body]}},
        }
    if op.public:
        described["security"] = []
    return described


@functools.cache
def openapi_document() -> dict[str, Any]:
    """The document, built once per process from OPERATIONS and the request models."""
    models: list[type[BaseModel]] = [
        CompletionRequest, ChatCompletionRequest, BatchRequest, FileUpload, ErrorBody,
    ]  # fmt: skip
    by_model, definitions = models_json_schema(
        [(model, "validation") for model in models], ref_template=REF
    )
    refs = {model: by_model[(model, "validation")] for model in models}
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": "llmqueue",
            "version": "v1",
            "description": "OpenAI-compatible request queue in front of your own LLM engines.",
        },
        "paths": paths,
        "components": {
            "schemas": definitions["$defs"],
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
