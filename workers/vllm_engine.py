"""The real engine: vLLM's LLMEngine driven by the continuous-batching loop (GPU or CPU build)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from workers.batching import ContinuousEngine
from workers.engine import EngineError, GenerationRequest, GenerationResult, PromptTooLong

# How vLLM words a prompt that does not fit (its input processor, and its client-side check).
_TOO_LONG = ("maximum context length", "longer than the maximum model length")


@dataclass(frozen=True)
class VllmConfig:
    model: str
    max_num_seqs: int = 64
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.9
    seed: int = 0
    in_process: bool = False
    """Run vLLM's engine core in this process (CPU build: loads in ~4 s instead of ~30 s). On a GPU
    keep it False: the multiprocess core keeps vLLM's busy loop out of the worker's GIL."""
    enforce_eager: bool = False
    cpu_threads: int = 0
    """CPU build: OpenMP threads for the engine's torch ops (0: torch's default, one per core).
    vLLM's own multiprocess CPU executor leaves a core to the process that schedules and feeds
    the engine; in-process, the worker's consumer, claims and Redis round trips need it the same
    way, or a request read from the broker waits for the busy cores (bench/headroom.py)."""

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "model": self.model,
            "max_num_seqs": self.max_num_seqs,
            "dtype": self.dtype,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "seed": self.seed,
            "scheduling_policy": "priority",
            "enforce_eager": self.enforce_eager,
            # vLLM's own stat loggers (Prometheus, periodic log lines) have no endpoint in this
            # worker and cost Python on every step under the GIL the task threads share; the
            # queue exports its own metrics. LLM (the offline API) turns them off the same way.
            "disable_log_stats": True,
        }
        if self.max_model_len:
            kwargs["max_model_len"] = self.max_model_len
        return kwargs


def prepare_vllm_environment(in_process: bool) -> None:
    """Environment vLLM reads at import; call before importing it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else "1")
    # Worker threads may not fork a CUDA-initialised process.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def sampling_params(request: GenerationRequest) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        # Only the finished output: the default (CUMULATIVE) builds a RequestOutput with the whole
        # text so far for every running request at every step, which nothing here reads. Both
        # LLM.generate and vLLM's non-streaming OpenAI server ask for FINAL_ONLY too.
        output_kind=RequestOutputKind.FINAL_ONLY,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        min_tokens=request.min_tokens,
        seed=request.seed,
        stop=request.stop or None,
        ignore_eos=request.ignore_eos,
    )


class VllmCore:
    """vLLM's LLMEngine without a thread of its own: whoever holds it steps it (the worker's
    engine thread, VllmEngine, or a process of its own, workers/engine_process.py)."""

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self._engine: Any = None
        self._tokenizer: Any = None
        self.torch_threads = 0  # what the stepping thread's torch ops use, once open

    def open(self) -> None:
        # Built on the thread that steps it, not the caller's: the CPU build's torch ops then run
        # from the one thread that also loaded the model, so they share one OpenMP thread team. A
        # second team (load on the main thread, steps on this one) puts more OpenMP threads than
        # cores on the host, and libgomp then stops spin-waiting: every op of every step waits
        # for a sleeping helper thread to wake (measured: ~3 ms more CPU per step, tiny Llama).
        prepare_vllm_environment(self.config.in_process)
        import torch

        if self.config.cpu_threads > 0:
            # Before vLLM's CPU worker replaces torch.set_num_threads with a no-op.
            torch.set_num_threads(self.config.cpu_threads)
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self._engine = LLMEngine.from_engine_args(EngineArgs(**self.config.engine_kwargs()))
        self._tokenizer = self._engine.get_tokenizer()
        self.torch_threads = torch.get_num_threads()

    def add(self, request: GenerationRequest) -> None:
        prompt: Any = request.prompt
        messages: Any = request.messages
        if messages is not None:
            prompt = self._tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        from vllm.exceptions import VLLMClientError

        try:
            self._engine.add_request(
                request.request_id, prompt, sampling_params(request), priority=request.priority
            )
        except (ValueError, VLLMClientError) as exc:  # the request's fault: prompt too long, ...
            message = str(exc)
            if any(marker in message for marker in _TOO_LONG):
                raise PromptTooLong(message) from exc
            raise EngineError(message) from exc

    def has_work(self) -> bool:
        return bool(self._engine.has_unfinished_requests())

    def step(self, step: int) -> list[GenerationResult]:
        """Run step number `step` (1-based); the requests it finished."""
        finished = []
        for output in self._engine.step():  # FINAL_ONLY: finished requests only
            if not output.finished:
                continue
            outputs: Any = output.outputs  # a list of CompletionOutput for generate requests
            completion = outputs[0]
            tokens = len(completion.token_ids)
            finished.append(
                GenerationResult(
                    request_id=output.request_id,
                    text=completion.text,
                    prompt_tokens=len(output.prompt_token_ids or ()),
                    completion_tokens=tokens,
                    finish_reason=completion.finish_reason or "stop",
                    # After its first token a running request decodes one token per step: this
                    # is exact unless vLLM preempted the request (then it reads later).
                    first_token_step=max(1, step - tokens + 1),
                    finished_step=step,
                )
            )
        return finished

    def abort(self, request_ids: list[str]) -> None:
        self._engine.abort_request(request_ids)


class VllmEngine(ContinuousEngine):
    """vLLM's LLMEngine, stepped by the engine thread; requests join at every step."""

    def __init__(self, config: VllmConfig) -> None:
        super().__init__()
        self.config = config
        self.model_name = config.model
        self.core = VllmCore(config)
        self.start()

    @property
    def torch_threads(self) -> int:
        return self.core.torch_threads

    def _open(self) -> None:
        self.core.open()

    def _add(self, request: GenerationRequest) -> None:
        self.core.add(request)

    def _has_work(self) -> bool:
        return self.core.has_work()

    def _step(self) -> list[GenerationResult]:
        return self.core.step(self.steps + 1)

    def _abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)
