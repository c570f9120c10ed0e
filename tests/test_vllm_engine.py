"""The real engine adapter: vLLM's CPU build with the tiny local model, no Django, no Celery."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from workers.engine import EngineError, GenerationRequest
from workers.vllm_engine import VllmConfig, VllmEngine

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[VllmEngine]:
    engine = VllmEngine(
        VllmConfig(
            model=str(tiny_model),
            max_num_seqs=16,
            dtype="float32",
            max_model_len=2048,
            gpu_memory_utilization=0.1,
            in_process=True,
            enforce_eager=True,
            cpu_threads=1,
        )
    )
    yield engine
    engine.close()


def test_concurrent_requests_are_batched_into_shared_steps(engine: VllmEngine):
    steps_before = engine.steps
    futures = [
        engine.submit(
            GenerationRequest(f"batch-{i}", prompt=f"hello {i}", max_tokens=16, ignore_eos=True)
        )
        for i in range(16)
    ]
    results = [f.result(timeout=120) for f in futures]
    assert [r.completion_tokens for r in results] == [16] * 16
    assert all(r.text and r.finish_reason == "length" for r in results)
    # One at a time would take 16 × 16 steps; continuous batching shares them.
    assert engine.steps - steps_before <= 24


def test_the_engine_thread_uses_the_configured_cpu_threads(engine: VllmEngine):
    engine.submit(GenerationRequest("threads-1", prompt="hi", max_tokens=1)).result(timeout=60)
    assert engine.torch_threads == 1


def test_chat_uses_the_model_chat_template(engine: VllmEngine):
    messages = [{"role": "user", "content": "hello world"}]
    result = engine.submit(
        GenerationRequest("chat-1", messages=messages, max_tokens=4, ignore_eos=True)
    ).result(timeout=60)
    rendered = "<|user|>hello world\n<|assistant|>"
    expected_prompt = len(engine._tokenizer.encode(rendered))
    assert (result.prompt_tokens, result.completion_tokens) == (expected_prompt, 4)


def test_stop_and_greedy_sampling_are_applied(engine: VllmEngine):
    request = GenerationRequest("greedy-a", prompt="the queue", max_tokens=8, temperature=0.0)
    first = engine.submit(request).result(timeout=60)
    again = engine.submit(
        GenerationRequest("greedy-b", prompt="the queue", max_tokens=8, temperature=0.0)
    ).result(timeout=60)
    assert first.text == again.text  # greedy decoding is deterministic


def test_prompt_longer_than_the_context_is_an_engine_error(engine: VllmEngine):
    words = " ".join(f"w{i}" for i in range(3000))
    future = engine.submit(GenerationRequest("too-long", prompt=words, max_tokens=4))
    with pytest.raises(EngineError, match="maximum context length is 2048 tokens"):
        future.result(timeout=60)
    # The loop survives a rejected request.
    ok = engine.submit(GenerationRequest("after", prompt="hi", max_tokens=2, ignore_eos=True))
    assert ok.result(timeout=60).completion_tokens == 2


def test_an_aborted_request_leaves_the_engine_and_fails_its_future(engine: VllmEngine):
    import time

    from workers.batching import RequestAborted

    long = engine.submit(
        GenerationRequest("abort-long", prompt="hello", max_tokens=1500, ignore_eos=True)
    )
    started = engine.steps
    while engine.steps < started + 3:  # it is running, not just queued
        time.sleep(0.01)
    engine.abort("abort-long")
    with pytest.raises(RequestAborted):
        long.result(timeout=60)
    after = engine.submit(GenerationRequest("abort-after", prompt="hi", max_tokens=2))
    assert after.result(timeout=60).completion_tokens == 2
    assert engine.stats()["in_engine"] == 0
