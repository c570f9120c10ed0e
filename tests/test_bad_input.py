"""Bad input never reaches a 5xx (issue 14, part 7): each request found by hand that crashed the
API is a 4xx in OpenAI's error shape, through the production WSGI entry point, with nothing
stored or enqueued."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from io import BytesIO
from typing import Any
from wsgiref.util import setup_testing_defaults

import pytest
import redis
from django.conf import settings

from llmqueue.models import PromptRequest
from project.wsgi import application
from tests.conftest import Seeded, assert_nothing_enqueued, pretend_live

pytestmark = pytest.mark.django_db(transaction=True)
TWENTY_MB = 20 * 1024 * 1024
GOOD = {"model": "sim", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def error(self) -> dict[str, Any]:
        """The error object, checked to be OpenAI's shape: exactly its four keys."""
        assert self.headers["Content-Type"] == "application/json", self.body[:200]
        error: dict[str, Any] = json.loads(self.body)["error"]
        assert sorted(error) == ["code", "message", "param", "type"]
        assert isinstance(error["message"], str) and error["message"]
        return error


class BodyStream:
    """A wsgi.input of `size` bytes made as they are read, counting what was read."""

    def __init__(self, size: int, fill: bytes = b" ") -> None:
        self.left, self.fill, self.read_bytes = size, fill, 0

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        self.left -= size
        self.read_bytes += size
        return self.fill * size

    readline = read


@dataclass
class Call:
    method: str
    path: str
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    stream: Any = None
    # -1: the body's own length; None: none sent (chunked); a string: sent as it is.
    content_length: int | str | None = -1
    content_type: str = "application/json"


def call(request: Call) -> Answer:
    environ: dict[str, Any] = {
        "REQUEST_METHOD": request.method,
        "PATH_INFO": request.path,
        "wsgi.input": request.stream or BytesIO(request.body),
        "CONTENT_TYPE": request.content_type,
    }
    setup_testing_defaults(environ)
    environ["HTTP_HOST"] = "127.0.0.1"
    if request.content_length is None:
        environ["wsgi.input_terminated"] = True  # what a server that dechunks says
    elif request.content_length == -1:
        environ["CONTENT_LENGTH"] = str(len(request.body))
    else:
        environ["CONTENT_LENGTH"] = str(request.content_length)
    for name, value in request.headers.items():
        environ["HTTP_" + name.upper().replace("-", "_")] = value
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        seen["status"], seen["headers"] = int(status.split()[0]), dict(headers)

    body = b"".join(application(environ, start_response))
    return Answer(seen["status"], seen["headers"], body)


def post(path: str, body: Any, key: str | None = None, **headers: str) -> Answer:
    if key:
        headers["Authorization"] = f"Bearer {key}"
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return call(Call("POST", path, raw, headers))


@pytest.fixture
def quiet(seeded: Seeded, clean_redis: redis.Redis) -> Iterator[Seeded]:
    """The seeded tenant; afterwards, nothing of any request was stored or enqueued."""
    yield seeded
    assert_nothing_enqueued(clean_redis)


class Unreadable:
    def read(self, size: int = -1) -> bytes:
        raise AssertionError("the body was read")

    readline = read


# --- 20 MB bodies: 413 before the body is read or parsed ----------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/batches"])
def test_a_20_mb_body_is_413_by_its_content_length_and_never_read(quiet: Seeded, path: str):
    headers = {"Authorization": f"Bearer {quiet.key}"}
    answer = call(
        Call("POST", path, headers=headers, stream=Unreadable(), content_length=TWENTY_MB)
    )
    assert answer.status == 413
    error = answer.error()
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_too_large")
    assert str(settings.LLMQUEUE_MAX_BODY_BYTES) in error["message"]


def test_a_20_mb_chunked_body_is_413_once_it_passes_the_limit(quiet: Seeded):
    stream = BodyStream(TWENTY_MB)
    headers = {"Authorization": f"Bearer {quiet.key}", "Transfer-Encoding": "chunked"}
    answer = call(Call("POST", "/v1/completions", headers=headers, stream=stream,
                       content_length=None))  # fmt: skip
    assert answer.status == 413
    assert answer.error()["code"] == "request_too_large"
    assert stream.read_bytes <= settings.LLMQUEUE_MAX_BODY_BYTES + 64 * 1024


def test_a_small_chunked_body_is_read_and_parsed(quiet: Seeded):
    raw = json.dumps({**GOOD, "model": "nope"}).encode()
    stream = BytesIO(raw)
    headers = {"Authorization": f"Bearer {quiet.key}", "Transfer-Encoding": "chunked"}
    answer = call(Call("POST", "/v1/completions", headers=headers, stream=stream,
                       content_length=None))  # fmt: skip
    assert (answer.status, answer.error()["code"]) == (404, "model_not_found")


def test_djangos_own_body_limit_is_413_not_500(quiet: Seeded, settings: Any):
    """Django refuses a body past DATA_UPLOAD_MAX_MEMORY_SIZE itself (RequestDataTooBig): the
    errors module maps it, should the two limits ever differ."""
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 10
    answer = post("/v1/completions", GOOD, quiet.key)
    assert (answer.status, answer.error()["code"]) == (413, "request_too_large")


@pytest.mark.parametrize("length", ["-5", "12x"])
def test_a_negative_or_garbled_content_length_is_400(quiet: Seeded, length: str):
    answer = call(Call("POST", "/v1/completions", json.dumps(GOOD).encode(), content_length=length))
    assert (answer.status, answer.error()["code"]) == (400, "invalid_request")


# --- text that cannot be stored: a lone surrogate, NUL ------------------------------------------


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", b'{"model": "sim", "prompt": "\\ud800"}', "prompt"),
        ("/v1/completions", b'{"model": "sim", "prompt": ["a\\udfff"]}', "prompt[0]"),
        ("/v1/completions", b'{"model": "sim", "prompt": "a\\u0000b"}', "prompt"),
        # UTF-8 bytes of a surrogate (json reads them through, as Python's json.loads does)
        ("/v1/completions", b'{"model": "sim", "prompt": "\xed\xa0\x80"}', "prompt"),
        ("/v1/completions", b'{"model": "sim\\ud800", "prompt": "hi"}', "model"),
        ("/v1/completions", b'{"model": "sim", "prompt": "hi", "stop": ["\\ud800"]}', "stop[0]"),
        ("/v1/completions", b'{"model": "sim", "prompt": "hi", "user": "\\u0000"}', "user"),
        (
            "/v1/chat/completions",
            b'{"model": "sim", "messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            b'{"model": "sim", "messages": [{"role": "user", "content": '
            b'[{"type": "text", "text": "\\udc00"}]}]}',
            "messages[0].content[0].text",
        ),
    ],
)
def test_text_with_a_lone_surrogate_or_nul_is_400_naming_the_field(
    quiet: Seeded, path: str, raw: bytes, param: str
):
    answer = post(path, raw, quiet.key)
    assert answer.status == 400, answer.body
    error = answer.error()
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_text",
        param,
    )


# --- nesting ------------------------------------------------------------------------------------


def nested(depth: int) -> bytes:
    return b"[" * depth + b'"hi"' + b"]" * depth


def test_content_nested_5000_arrays_deep_is_400(quiet: Seeded):
    raw = b'{"model": "sim", "messages": [{"role": "user", "content": ' + nested(5000) + b"}]}"
    answer = post("/v1/chat/completions", raw, quiet.key)
    assert (answer.status, answer.error()["code"]) == (400, "invalid_json")


def test_content_nested_a_hundred_deep_is_400_naming_where(quiet: Seeded):
    raw = b'{"model": "sim", "messages": [{"role": "user", "content": ' + nested(100) + b"}]}"
    answer = post("/v1/chat/completions", raw, quiet.key)
    error = answer.error()
    assert (answer.status, error["code"]) == (400, "invalid_request")
    assert error["param"].startswith("messages[0].content[0][0]")


def test_a_batch_line_nested_5000_deep_fails_its_batch_not_the_server(quiet: Seeded):
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": '
    upload = upload_file(quiet.key, line + nested(5000) + b"}\n")
    assert upload.status == 200, upload.body
    made = post("/v1/batches", {"input_file_id": json.loads(upload.body)["id"],
                                "endpoint": "/v1/completions", "completion_window": "24h"},
                quiet.key)  # fmt: skip
    assert made.status == 200, made.body
    batch = json.loads(made.body)
    assert batch["status"] == "failed"
    assert batch["errors"]["data"][0]["code"] == "invalid_json"


def upload_file(key: str, data: bytes) -> Answer:
    boundary = "b0undary"
    raw = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    headers = {"Authorization": f"Bearer {key}"}
    content_type = f"multipart/form-data; boundary={boundary}"
    return call(Call("POST", "/v1/files", raw, headers, content_type=content_type))


# --- integers the engine cannot hold ------------------------------------------------------------

HUGE = 99999999999999999999999


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**GOOD, "seed": HUGE}, "seed"),
        ("/v1/completions", {**GOOD, "seed": 2**63}, "seed"),
        ("/v1/completions", {**GOOD, "seed": -(2**63) - 1}, "seed"),
        ("/v1/completions", {**GOOD, "top_k": 2**31}, "top_k"),
        ("/v1/completions", {**GOOD, "max_tokens": HUGE}, "max_tokens"),
        ("/v1/completions", {**GOOD, "min_tokens": -HUGE}, "min_tokens"),
        ("/v1/completions", {**GOOD, "n": 2**40}, "n"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": HUGE}, "max_completion_tokens"),
    ],
)
def test_an_integer_beyond_what_the_engine_holds_is_400_naming_it(
    quiet: Seeded, path: str, body: dict[str, Any], param: str
):
    answer = post(path, body, quiet.key)
    assert answer.status == 400, answer.body
    error = answer.error()
    assert (error["code"], error["param"]) == ("integer_out_of_range", param)


def test_the_largest_seed_is_admitted(seeded: Seeded, clean_redis: redis.Redis):
    pretend_live(clean_redis, "default")
    answer = post("/v1/completions", {**GOOD, "seed": 2**63 - 1, "background": True}, seeded.key)
    assert answer.status == 202, answer.body
    assert PromptRequest.objects.get().params["seed"] == 2**63 - 1


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "sim", "prompt": "hi", "temperature": NaN}',
        b'{"model": "sim", "prompt": "hi", "temperature": -Infinity}',
        b'{"model": "sim", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}",
    ],
)
def test_nan_infinity_and_5000_digit_numbers_are_invalid_json(quiet: Seeded, raw: bytes):
    answer = post("/v1/completions", raw, quiet.key)
    assert (answer.status, answer.error()["code"]) == (400, "invalid_json")


# --- other types the validators met unprepared --------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": [], "content": "x"}]}, 400,
         "messages[0]"),
        ("/v1/completions", {**GOOD, "stream": "yes"}, 400, "stream"),
        ("/v1/batches", {"input_file_id": "f", "endpoint": "/v1/completions",
                         "completion_window": []}, 422, "completion_window"),
        ("/v1/batches", {"input_file_id": "f", "endpoint": {}, "completion_window": "24h"}, 422,
         "endpoint"),
    ],
)  # fmt: skip
def test_unhashable_or_mistyped_values_are_4xx(
    quiet: Seeded, path: str, body: dict[str, Any], status: int, param: str
):
    answer = post(path, body, quiet.key)
    assert answer.status == status, answer.body
    assert answer.error()["param"] == param


# --- 404 and 405: JSON, never Django's page -----------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/requests/not-a-uuid"),
        ("GET", "/v1/requests/a/b"),
        ("GET", "/v1/requests/"),
        ("POST", "/v1/requests/%00/cancel"),
        ("GET", "/v1/batches/x/y/z"),
        ("GET", "/v1/files/\x00"),
        ("GET", "/v1/nope"),
        ("POST", "/v1/completion"),
        ("GET", "/v1/models/"),
        ("DELETE", "/v1/"),
        ("GET", "/v1/line\nbreak"),
    ],
)
def test_every_v1_404_is_json(quiet: Seeded, method: str, path: str):
    answer = call(Call(method, path, headers={"Authorization": f"Bearer {quiet.key}"}))
    assert answer.status == 404, answer.body
    assert answer.error()["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [("GET", "/v1/completions", "POST"), ("DELETE", "/v1/models", "GET"),
     ("PUT", "/v1/files", "GET, POST"), ("POST", "/v1/models", "GET")],
)  # fmt: skip
def test_every_v1_405_is_json_with_allow(quiet: Seeded, method: str, path: str, allow: str):
    answer = call(Call(method, path, headers={"Authorization": f"Bearer {quiet.key}"}))
    assert answer.status == 405
    assert answer.error()["code"] == "method_not_allowed"
    assert answer.headers["Allow"] == allow


def test_a_host_not_allowed_is_a_json_400_under_v1(quiet: Seeded):
    request = Call("GET", "/v1/models", headers={"Host": "evil.example"})
    answer = call(request)
    assert answer.status == 400
    assert answer.error()["code"] == "invalid_request"


def test_pages_outside_v1_keep_djangos_404(quiet: Seeded):
    answer = call(Call("GET", "/nothing-here"))
    assert answer.status == 404
    assert answer.headers["Content-Type"].startswith("text/html")
