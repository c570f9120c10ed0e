"""Traffic for the scheduling bench: trace replay, a lognormal batch stream, prompts of a length.

A trace is any CSV with the columns `arrived_at` (seconds from the trace start),
`num_prefill_tokens` (prompt length) and `num_decode_tokens` (output length), as the Azure LLM
inference trace in bench/traces/ (see its README). Replay keeps a contiguous slice of the
trace, so its burstiness survives, and compresses (or stretches) its clock so the slice offers
the wanted mean rate. Everything here is in *trace seconds*; bench/scheduling.py maps them to
wall time.
"""

from __future__ import annotations

import csv
import math
import random
from dataclasses import dataclass
from pathlib import Path

_WORD = "tok "  # 4 bytes: exactly one token at the default LLMQUEUE_BYTES_PER_TOKEN


@dataclass(frozen=True)
class TraceRow:
    arrived_at: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class Arrival:
    """One request to send: when (trace s from the window start), to which stream, how long."""

    at: float
    stream: str  # "interactive" | "batch"
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class LognormalFit:
    """ln(length) ~ Normal(mu, sigma), for prompt and output lengths separately."""

    prompt_mu: float
    prompt_sigma: float
    output_mu: float
    output_sigma: float

    def scaled(self, prompt_factor: float, output_factor: float) -> LognormalFit:
        """The same spread, medians multiplied by the factors (another length mix)."""
        return LognormalFit(
            self.prompt_mu + math.log(prompt_factor),
            self.prompt_sigma,
            self.output_mu + math.log(output_factor),
            self.output_sigma,
        )

    def describe(self) -> dict[str, float]:
        return {
            "prompt_mu": round(self.prompt_mu, 4),
            "prompt_sigma": round(self.prompt_sigma, 4),
            "prompt_median_tokens": round(math.exp(self.prompt_mu), 1),
            "output_mu": round(self.output_mu, 4),
            "output_sigma": round(self.output_sigma, 4),
            "output_median_tokens": round(math.exp(self.output_mu), 1),
        }


def read_trace(path: Path) -> list[TraceRow]:
    """The rows of a trace CSV, in arrival order."""
    with path.open(newline="") as handle:
        rows = [
            TraceRow(
                float(row["arrived_at"]),
                max(1, int(float(row["num_prefill_tokens"]))),
                max(1, int(float(row["num_decode_tokens"]))),
            )
            for row in csv.DictReader(handle)
        ]
    if len(rows) < 2:
        raise ValueError(f"{path}: a trace needs at least two rows")
    return sorted(rows, key=lambda r: r.arrived_at)


def fit_lognormal(rows: list[TraceRow]) -> LognormalFit:
    """Maximum-likelihood lognormal fit (mean and standard deviation of the log lengths)."""

    def mu_sigma(values: list[int]) -> tuple[float, float]:
        logs = [math.log(v) for v in values]
        mu = sum(logs) / len(logs)
        return mu, math.sqrt(sum((x - mu) ** 2 for x in logs) / len(logs))

    prompt = mu_sigma([r.prompt_tokens for r in rows])
    output = mu_sigma([r.output_tokens for r in rows])
    return LognormalFit(prompt[0], prompt[1], output[0], output[1])


def replay(
    rows: list[TraceRow], stream: str, rate: float, window: float, offset: int = 0
) -> list[Arrival]:
    """round(rate × window) consecutive rows from `offset` (wrapping around), their gaps scaled
    by one factor so the slice spans `window` seconds: the trace's own bursts at `rate` per s."""
    count = max(1, round(rate * window))
    picked: list[TraceRow] = []
    times: list[float] = []
    elapsed = 0.0
    for i in range(count + 1):  # one row more: the gap after the last one counts too
        row = rows[(offset + i) % len(rows)]
        if i:
            prev = rows[(offset + i - 1) % len(rows)]
            # Wrapping to the start: the gap of a mean row instead of a negative one.
            gap = row.arrived_at - prev.arrived_at
            elapsed += gap if gap >= 0 else _mean_gap(rows)
        times.append(elapsed)
        picked.append(row)
    scale = window / times[-1] if times[-1] > 0 else 0.0
    return [
        Arrival(t * scale, stream, row.prompt_tokens, row.output_tokens)
        for t, row in zip(times[:-1], picked[:-1], strict=True)
    ]


def poisson_rows(
    rows: list[TraceRow],
    stream: str,
    rate: float,
    window: float,
    rng: random.Random,
    offset: int = 0,
) -> list[Arrival]:
    """Poisson arrivals at `rate` over `window`, lengths from consecutive rows from `offset`
    (wrapping around): the trace's length mix at a steady rate, without its minute-scale swings."""
    arrivals: list[Arrival] = []
    at = rng.expovariate(rate)
    i = offset
    while at < window:
        row = rows[i % len(rows)]
        arrivals.append(Arrival(at, stream, row.prompt_tokens, row.output_tokens))
        at += rng.expovariate(rate)
        i += 1
    return arrivals


def _mean_gap(rows: list[TraceRow]) -> float:
    return (rows[-1].arrived_at - rows[0].arrived_at) / (len(rows) - 1)


def poisson_lognormal(
    fit: LognormalFit,
    stream: str,
    rate: float,
    window: float,
    rng: random.Random,
    max_prompt_tokens: int,
    max_output_tokens: int,
) -> list[Arrival]:
    """Poisson arrivals at `rate` over `window`, lengths drawn from `fit` (clipped to the model's
    limits, so no request is refused for its size)."""
    arrivals: list[Arrival] = []
    at = rng.expovariate(rate)
    while at < window:
        prompt = min(
            max_prompt_tokens, max(1, round(rng.lognormvariate(fit.prompt_mu, fit.prompt_sigma)))
        )
        output = min(
            max_output_tokens, max(1, round(rng.lognormvariate(fit.output_mu, fit.output_sigma)))
        )
        arrivals.append(Arrival(at, stream, prompt, output))
        at += rng.expovariate(rate)
    return arrivals


def clip(arrivals: list[Arrival], max_prompt_tokens: int, max_output_tokens: int) -> list[Arrival]:
    """Trace entries longer than the model allows, cut to fit (counted by the caller)."""
    return [
        Arrival(
            a.at,
            a.stream,
            min(a.prompt_tokens, max_prompt_tokens),
            min(a.output_tokens, max_output_tokens),
        )
        for a in arrivals
    ]


def prompt_text(tokens: int) -> str:
    """A prompt the simulated engine and admission both count as `tokens` tokens (they estimate
    ceil(UTF-8 bytes / bytes_per_token), 4 by default)."""
    return _WORD * tokens
