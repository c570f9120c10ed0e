"""The demo's burst of prompts: a small HTTP client, the requests, the results table."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

MODEL_NAME = "tiny-llama"
HTTP_TIMEOUT_SECONDS = 120.0
MAX_RETRIES = 5
MAX_TOKENS = 32
REQUEST_ID_HEADER = "X-LLMQueue-Request-Id"

_SEEDS = (
    "the quick brown fox",
    "a queue decides who gets the gpu",
    "hello world, how are you?",
    "one two three four five",
    "tenants send prompts",
    "workers batch them",
    "results come back",
    "llmqueue admits, routes and serves",
    "the lazy dog",
)


@dataclass(frozen=True)
class PromptOutcome:
    index: int
    endpoint: str
    status: int
    request_id: str
    completion_tokens: int
    text: str
    error: str = ""

    @property
    def succeeded(self) -> bool:
        return self.status == 200


def http_json(
    method: str, url: str, key: str, body: dict[str, Any] | None, timeout_seconds: float
) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, JSON body, headers); status 0 when nothing answered."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method)
    request.add_header("Authorization", f"Bearer {key}")
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=timeout_seconds) as response:
            return response.status, json.loads(response.read()), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, _error_body(error.read()), dict(error.headers)
    except (OSError, ValueError) as exc:
        return 0, {"error": {"message": str(exc)}}, {}


def _error_body(raw: bytes) -> dict[str, Any]:
    try:
        parsed: dict[str, Any] = json.loads(raw)
    except ValueError:
        return {"error": {"message": raw.decode(errors="replace")[:200]}}
    return parsed


def listed_models(base_url: str, key: str) -> list[str]:
    status, body, _ = http_json("GET", f"{base_url}/v1/models", key, None, timeout_seconds=2.0)
    if status != 200:
        return []
    return [m["id"] for m in body.get("data", [])]


def prompt_requests(count: int) -> list[tuple[str, dict[str, Any]]]:
    """(endpoint, body) pairs: completions and chat completions, alternating."""
    requests: list[tuple[str, dict[str, Any]]] = []
    for i in range(count):
        seed = _SEEDS[i % len(_SEEDS)]
        if i % 2 == 0:
            body: dict[str, Any] = {"model": MODEL_NAME, "prompt": seed, "max_tokens": MAX_TOKENS}
            requests.append(("completions", body))
        else:
            messages = [{"role": "user", "content": seed}]
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": MAX_TOKENS}
            requests.append(("chat/completions", body))
    return requests


def completion_text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def send_prompt(
    base_url: str, key: str, index: int, endpoint: str, body: dict[str, Any]
) -> PromptOutcome:
    """One blocking request; 429/503 are retried after Retry-After, as the openai SDK does."""
    for _attempt in range(MAX_RETRIES):
        status, reply, headers = http_json(
            "POST", f"{base_url}/v1/{endpoint}", key, body, HTTP_TIMEOUT_SECONDS
        )
        if status not in (429, 503):
            break
        time.sleep(float(headers.get("Retry-After", "1")))
    request_id = headers.get(REQUEST_ID_HEADER, "")
    if status != 200:
        message = str(reply.get("error", {}).get("message", reply))
        return PromptOutcome(index, endpoint, status, request_id, 0, "", message)
    tokens = int(reply["usage"]["completion_tokens"])
    return PromptOutcome(index, endpoint, status, request_id, tokens, completion_text(reply))


def send_prompts(base_url: str, key: str, count: int, concurrency: int) -> list[PromptOutcome]:
    from tqdm import tqdm

    outcomes = []
    with (
        ThreadPoolExecutor(max_workers=concurrency) as pool,
        tqdm(total=count, desc="      prompts", unit="req") as bar,
    ):
        futures = [
            pool.submit(send_prompt, base_url, key, i, endpoint, body)
            for i, (endpoint, body) in enumerate(prompt_requests(count))
        ]
        for future in as_completed(futures):
            outcomes.append(future.result())
            bar.update()
    return sorted(outcomes, key=lambda o: o.index)


def _printable(text: str, width: int = 48) -> str:
    # A random model emits any byte: keep the table one printable line per row.
    return "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)[:width]


def results_table(outcomes: list[PromptOutcome], rows: int = 8) -> str:
    shown = outcomes[:rows] + [o for o in outcomes[rows:] if not o.succeeded]
    lines = [f"      {'#':>3}  {'endpoint':<17} {'request id':<10} {'HTTP':>4} {'tokens':>6}  text"]
    for o in shown:
        text = _printable(o.text if o.succeeded else f"error: {o.error}")
        lines.append(
            f"      {o.index:>3}  {o.endpoint:<17} {o.request_id[:8]:<10} {o.status:>4} "
            f"{o.completion_tokens:>6}  {text}"
        )
    if len(outcomes) > len(shown):
        lines.append(f"      … and {len(outcomes) - len(shown)} more")
    return "\n".join(lines)


def summary(outcomes: list[PromptOutcome], elapsed_seconds: float) -> str:
    succeeded = sum(o.succeeded for o in outcomes)
    tokens = sum(o.completion_tokens for o in outcomes)
    line = (
        f"      {succeeded}/{len(outcomes)} prompts succeeded, {tokens} tokens generated in "
        f"{elapsed_seconds:.1f} s ({len(outcomes) / elapsed_seconds:.1f} requests/s)"
    )
    failures = Counter(o.status for o in outcomes if not o.succeeded)
    if failures:
        line += "; failed: " + ", ".join(f"{n} x HTTP {s}" for s, n in sorted(failures.items()))
    return line
