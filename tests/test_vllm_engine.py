"""The real engine adapter: vLLM's CPU build with the tiny local model, no Django, no Celery;
stepped on the worker's engine thread and in an engine process of its own."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.test_processes import alive, wait_for
from workers.batching import ContinuousEngine
from workers.engine import EngineError, GenerationRequest
from workers.engine_process import ProcessEngine
from workers.engines import EngineOptions, build_engine
from workers.vllm_engine import VllmConfig, VllmCore, VllmEngine

pytestmark = pytest.mark.vllm


def tiny_config(model: Path) -> VllmConfig:
    return VllmConfig(
        model=str(model),
        max_num_seqs=16,
        dtype="float32",
        max_model_len=2048,
        gpu_memory_utilization=0.1,
        in_process=True,
        enforce_eager=True,
        cpu_threads=1,
    )


def process_engine(model: Path) -> ProcessEngine:
    return ProcessEngine(functools.partial(VllmCore, tiny_config(model)), str(model))


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[ContinuousEngine]:
    if request.param == "thread":
        engine: ContinuousEngine = VllmEngine(tiny_config(tiny_model))
    else:
        engine = process_engine(tiny_model)
    yield engine
    engine.close()


def test_concurrent_requests_are_batched_into_shared_steps(engine: ContinuousEngine):
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


def test_the_engine_thread_uses_the_configured_cpu_threads(engine: ContinuousEngine):
    engine.submit(GenerationRequest("threads-1", prompt="hi", max_tokens=1)).result(timeout=60)
    assert isinstance(engine, VllmEngine | ProcessEngine)
    assert engine.torch_threads == 1


def test_chat_uses_the_model_chat_template(engine: ContinuousEngine, tiny_model: Path):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hello world"}]
    result = engine.submit(
        GenerationRequest("chat-1", messages=messages, max_tokens=4, ignore_eos=True)
    ).result(timeout=60)
    rendered = "<|user|>hello world\n<|assistant|>"
    expected_prompt = len(AutoTokenizer.from_pretrained(str(tiny_model)).encode(rendered))
    assert (result.prompt_tokens, result.completion_tokens) == (expected_prompt, 4)


def test_stop_and_greedy_sampling_are_applied(engine: ContinuousEngine):
    request = GenerationRequest("greedy-a", prompt="the queue", max_tokens=8, temperature=0.0)
    first = engine.submit(request).result(timeout=60)
    again = engine.submit(
        GenerationRequest("greedy-b", prompt="the queue", max_tokens=8, temperature=0.0)
    ).result(timeout=60)
    assert first.text == again.text  # greedy decoding is deterministic


def test_prompt_longer_than_the_context_is_an_engine_error(engine: ContinuousEngine):
    words = " ".join(f"w{i}" for i in range(3000))
    future = engine.submit(GenerationRequest("too-long", prompt=words, max_tokens=4))
    with pytest.raises(EngineError, match="maximum context length is 2048 tokens"):
        future.result(timeout=60)
    # The loop survives a rejected request.
    ok = engine.submit(GenerationRequest("after", prompt="hi", max_tokens=2, ignore_eos=True))
    assert ok.result(timeout=60).completion_tokens == 2


def test_an_aborted_request_leaves_the_engine_and_fails_its_future(engine: ContinuousEngine):
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


def test_a_dead_engine_process_fails_its_requests(tiny_model: Path):
    engine = process_engine(tiny_model)
    try:
        pid = engine.child_pid
        assert pid is not None
        running = engine.submit(
            GenerationRequest("doomed", prompt="hello", max_tokens=1500, ignore_eos=True)
        )
        started = engine.steps
        while engine.steps < started + 3:
            time.sleep(0.01)
        assert engine.stats()["process_cpu_seconds"] > 0  # the worker's CPU figure adds it
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process died"):
            running.result(timeout=60)
        assert engine.stats()["in_engine"] == 0
    finally:
        engine.close()


def test_an_engine_process_leaves_the_worker_a_core_unless_told_otherwise(tiny_model: Path):
    options = EngineOptions(
        model=str(tiny_model), max_num_seqs=4, dtype="float32", max_model_len=2048,
        gpu_memory_utilization=0.1, in_process=True, engine_process=True, enforce_eager=True,
    )  # fmt: skip
    engine = build_engine(options)
    try:
        assert isinstance(engine, ProcessEngine)
        cores = len(os.sched_getaffinity(0))
        assert engine.torch_threads == max(1, cores - 1)
        done = engine.submit(GenerationRequest("spare-core", prompt="hi", max_tokens=3))
        assert done.result(timeout=60).completion_tokens == 3
    finally:
        engine.close()


_PARENT = """
import functools, sys, time
from workers.engine import GenerationRequest
from workers.engine_process import ProcessEngine
from workers.vllm_engine import VllmConfig, VllmCore
config = VllmConfig(model=sys.argv[1], max_num_seqs=4, dtype="float32", max_model_len=2048,
                    gpu_memory_utilization=0.1, in_process=True, enforce_eager=True, cpu_threads=1)
engine = ProcessEngine(functools.partial(VllmCore, config), sys.argv[1])
engine.submit(GenerationRequest("one", prompt="hi", max_tokens=2)).result(60)
print("engine-pid", engine.child_pid, flush=True)
engine.submit(GenerationRequest("long", prompt="hi", max_tokens=1500, ignore_eos=True))
time.sleep(600)
"""


def test_an_engine_process_exits_with_its_worker_killed_mid_step(tiny_model: Path):
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, str(tiny_model)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert parent.stdout is not None
        # vLLM logs to stdout too.
        pid = next(int(line.split()[1]) for line in parent.stdout if line.startswith("engine-pid"))
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    # The pipe's end of file tells the child; nothing else is left to stop it.
    assert wait_for(lambda: not alive(pid), timeout=30)
