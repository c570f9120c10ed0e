"""A simulated GPU engine: vLLM-like continuous batching whose step time follows a fitted GPU model.

It stands in for a GPU in benchmarks of scheduling at GPU scale (there is no GPU here). It batches
exactly like the real adapter (same loop, same max_num_seqs, priority-ordered waiting queue, chunked
prefill under a token budget); only the arithmetic is replaced by a sleep of the modelled duration.
"""

from __future__ import annotations

import heapq
import itertools
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field

from workers.batching import ContinuousEngine
from workers.engine import GenerationRequest, GenerationResult

_CRASH_AFTER_SECONDS = 1.0
_WORDS = ("lorem", "ipsum", "dolor", "sit", "amet", "consectetur", "adipiscing", "elit")


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds one engine step takes, as a function of the tokens it processes.

    step = base + max(floor, per_batch_token × batch tokens) + per_context_token × total context.
    Defaults: an 8B model on one H100 (fits of measured vLLM profiles, as used by Vidur-style
    simulators): 1 ms fixed overhead, a 6.4 ms memory-bound floor for decode-only batches,
    23.3 µs per batched (prefill or decode) token once compute-bound, 0.056 µs per token of
    context held by the batch (attention reads). `time_scale` multiplies the result (0 = no wait).
    """

    base_s: float = 1.0e-3
    floor_s: float = 6.4e-3
    per_batch_token_s: float = 23.3e-6
    per_context_token_s: float = 0.056e-6
    time_scale: float = 1.0

    def step_seconds(self, batch_tokens: int, context_tokens: int) -> float:
        compute = max(self.floor_s, self.per_batch_token_s * batch_tokens)
        return self.time_scale * (self.base_s + compute + self.per_context_token_s * context_tokens)


@dataclass(frozen=True)
class SimulatedConfig:
    model: str = "simulated"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    bytes_per_token: float = 4.0
    step_time: StepTimeModel = field(default_factory=StepTimeModel)
    # A fault for tests: a request whose prompt holds this text kills the process a second into
    # its generation (its claim recorded by then, as in a real crash mid-generation).
    crash_on: str = ""
    # Another: the engine's step never returns once a request holding this text is running
    # (a hung GPU step); the worker's watchdog must notice.
    hang_on: str = ""


@dataclass
class _Sequence:
    request: GenerationRequest
    prompt_tokens: int
    prefilled: int = 0
    generated: int = 0
    first_token_step: int = 0
    added_at: float = field(default_factory=time.monotonic)


def count_prompt_tokens(request: GenerationRequest, bytes_per_token: float) -> int:
    if request.messages is not None:
        return sum(
            max(1, math.ceil(len(m["content"].encode()) / bytes_per_token)) + 4
            for m in request.messages
        )
    return max(1, math.ceil(len(request.prompt.encode()) / bytes_per_token))


def _text(seq: _Sequence) -> str:
    """A sequence's prompt text, messages included (what the test faults look for)."""
    messages = seq.request.messages or ()
    return seq.request.prompt + "".join(str(m.get("content", "")) for m in messages)


class SimulatedEngine(ContinuousEngine):
    def __init__(self, config: SimulatedConfig, start: bool = True) -> None:
        """`start=False` leaves the engine thread off so tests can drive steps themselves."""
        super().__init__()
        self.config = config
        self.model_name = config.model
        self._order = itertools.count()
        self._waiting: list[tuple[int, int, _Sequence]] = []
        self._running: list[_Sequence] = []
        self.busy_seconds = 0.0
        if start:
            self.start()

    def _add(self, request: GenerationRequest) -> None:
        seq = _Sequence(request, count_prompt_tokens(request, self.config.bytes_per_token))
        heapq.heappush(self._waiting, (request.priority, next(self._order), seq))

    def _has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def _abort(self, request_ids: list[str]) -> None:
        ids = set(request_ids)
        self._running = [s for s in self._running if s.request.request_id not in ids]
        self._waiting = [w for w in self._waiting if w[2].request.request_id not in ids]
        heapq.heapify(self._waiting)

    def _schedule(self) -> int:
        """Pick this step's work like vLLM V1's scheduler; return the batched token count.

        Running sequences first (decodes, one token each, then their unfinished prefill chunks,
        in the order they joined); then waiting requests join in priority order while a sequence
        slot and some of the step's token budget are left. So an urgent arrival waits for the
        prefill already under way, never for every less urgent request queued before it.
        """
        budget = self.config.max_num_batched_tokens
        batch = sum(1 for seq in self._running if seq.prefilled == seq.prompt_tokens)
        for seq in self._running:
            batch += self._prefill_chunk(seq, budget - batch)
        while self._waiting and len(self._running) < self.config.max_num_seqs and batch < budget:
            seq = heapq.heappop(self._waiting)[2]
            self._running.append(seq)
            batch += self._prefill_chunk(seq, budget - batch)
        return batch

    @staticmethod
    def _prefill_chunk(seq: _Sequence, room: int) -> int:
        chunk = max(0, min(seq.prompt_tokens - seq.prefilled, room))
        seq.prefilled += chunk
        return chunk

    def _step(self) -> list[GenerationResult]:
        step = self.steps + 1
        batch = self._schedule()
        context = sum(s.prefilled + s.generated for s in self._running)
        seconds = self.config.step_time.step_seconds(batch, context)
        if seconds > 0:
            time.sleep(seconds)
            self.busy_seconds += seconds
        if self.config.crash_on:
            self._crash_if_poisoned()
        if self.config.hang_on and any(self.config.hang_on in _text(s) for s in self._running):
            threading.Event().wait()
        finished, still = [], []
        for seq in self._running:
            if seq.prefilled < seq.prompt_tokens:  # still prefilling: no token yet
                still.append(seq)
                continue
            if not seq.generated:  # the step that completes prefill emits the first token
                seq.first_token_step = step
            seq.generated += 1
            if seq.generated >= seq.request.max_tokens:
                finished.append(self._result(seq, step))
            else:
                still.append(seq)
        self._running = still
        return finished

    def _crash_if_poisoned(self) -> None:
        now = time.monotonic()
        for seq in self._running:
            if self.config.crash_on in _text(seq) and now - seq.added_at >= _CRASH_AFTER_SECONDS:
                os.kill(os.getpid(), signal.SIGKILL)

    def _result(self, seq: _Sequence, step: int) -> GenerationResult:
        words = (_WORDS[i % len(_WORDS)] for i in range(seq.generated))
        return GenerationResult(
            request_id=seq.request.request_id,
            text=" " + " ".join(words),
            prompt_tokens=seq.prompt_tokens,
            completion_tokens=seq.generated,
            finish_reason="length",
            first_token_step=seq.first_token_step,
            finished_step=step,
        )
