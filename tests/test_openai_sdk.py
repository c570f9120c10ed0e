"""The official openai SDK against llmqueue: live server → Redis → real vLLM CPU worker (its
engine in a process of its own, workers/engine_process.py)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from llmqueue.models import PromptRequest
from tests.conftest import Seeded, WorkerFactory, vllm_args

pytestmark = [pytest.mark.vllm, pytest.mark.django_db(transaction=True)]


def test_openai_sdk_completions_chat_models_and_errors(
    live_server, seeded: Seeded, start_worker: WorkerFactory, tiny_model: Path
):
    start_worker("tiny", *vllm_args(tiny_model, engine_process=True), timeout=300)
    # max_retries=0: the SDK would otherwise retry 5xx/429 itself and hide our statuses.
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=seeded.key, max_retries=0)

    assert [m.id for m in client.models.list().data] == ["tiny-llama"]

    completion = client.completions.create(
        model="tiny-llama",
        prompt="the quick brown fox",
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert completion.object == "text_completion"
    assert completion.choices[0].finish_reason == "length"
    assert isinstance(completion.choices[0].text, str) and completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 8

    chat = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens == 6
    rows = PromptRequest.objects.order_by("enqueued_at")
    assert [(r.kind, r.status, r.completion_tokens) for r in rows] == [
        ("completion", "succeeded", 8),
        ("chat", "succeeded", 6),
    ]

    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=100_000)
    bad_key = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="lq-nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.completions.create(model="tiny-llama", prompt="x", max_tokens=2)
    assert PromptRequest.objects.count() == 2  # none of the rejected calls was stored

    # The API's byte estimate lets this prompt through; the engine's tokenizer counts it over
    # the 2048-token context: the caller still gets 413, and the row says why it failed.
    words = " ".join(f"w{i}" for i in range(1400))
    with pytest.raises(openai.APIStatusError) as too_long:
        client.completions.create(model="tiny-llama", prompt=words, max_tokens=4)
    assert too_long.value.status_code == 413
    assert too_long.value.code == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in too_long.value.message
    row = PromptRequest.objects.order_by("-enqueued_at").first()
    assert row is not None and (row.status, row.attempts) == ("failed", 1)
    assert "maximum context length is 2048 tokens" in row.error
