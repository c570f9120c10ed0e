"""Bulk jobs through the Batch API: acceptance of a big file, a job on the vLLM engine against
LLM.generate, interactive waits beside it, and fairness between two tenants' jobs.

    .venv/bin/python -m bench.bulk [--lines 10000] [--job-lines 1000] [--max-tokens 128]
                                   [--fair-lines 2000,200] [--interactive-seconds 20]
                                   [--interactive-interval 0.1]

Three phases, each with its own DB (temporary SQLite, or a PostgreSQL database when
$DATABASE_URL names a server) and Redis db, the API under granian and `manage.py bulk_pacer`:

1. enqueue: POST /v1/files then /v1/batches for `--lines` lines, timed until the batch answers
   (every line validated and stored held), with the API processes' peak RSS sampled meanwhile.
2. vllm: one vLLM worker (tiny model, the throughput bench's engine) and LLM.generate of the same
   prompts in a child. An interactive tenant sends one short request every
   `--interactive-interval` s (0.1: a p99 of 100-200 waits, not the largest of 20-40), first
   with no job (idle), then while a `--job-lines` job runs; each request's first-token wait is
   its row's first_token_at - enqueued_at. ratio = LLM.generate's time ÷ the job's, created to
   completed, the job run alone; then the same job runs again beside the interactive tenant
   (ratio_with_interactive: the headroom kept for it costs the job throughput).
3. fairness: two tenants of one tier, weight 1 each, on the simulated engine: a job of the first
   size, and 10 s later one of the second; service = prompt + generated tokens of the lines the
   pacer released, counted from the second job's creation while both have lines not released.
   fairness_gap_tokens is the largest difference in service; goal ≤ 4 × the largest request.
   (fairness_gap_at_claim_tokens counts at the workers' claims instead: the lines released
   before the second job arrived are claimed after it and count for the first tenant.)

Writes bench/results/bulk.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis

from bench import harness
from bench.latency import busy_cores, cpu_per_request, cpu_snapshot, percentile
from bench.throughput import (
    DirectRunner,
    add_bulk_slot_arguments,
    beat_after,
    engine_flags,
    prompts,
    task_slots,
)
from bench.throughput import worker_argv as vllm_worker_argv

HOST = "127.0.0.1"
REDIS_DB = 9
VLLM_MODEL = "tiny-llama"
VLLM_POOL = "bench"  # bench.throughput's worker serves this pool
SIM_MODEL = "sim"
SIM_POOL = "default"
NO_LIMIT = {"tokens_per_minute": 10**9, "requests_per_second": 10_000.0, "burst": 10_000}
GOALS = {"enqueue_10k_s": 10.0, "ratio": 0.85, "interactive_p99_during_vs_idle": 2.0,
         "fairness_gap_vs_largest": 4.0}  # fmt: skip


class Phase:
    """One phase's DB, Redis db, API server and pacer; `close` stops what it started."""

    def __init__(self, name: str, tenants: list[dict[str, Any]], **seed: Any) -> None:
        self.database = harness.bench_database(f"llmqueue_bench_bulk_{name}")
        self.redis_url = harness.redis_url(REDIS_DB)
        harness.flush_redis(self.redis_url)
        self.env = harness.bench_env(self.database, self.redis_url, VLLM_LOGGING_LEVEL="WARNING")
        harness.migrate(self.env)
        self.keys = harness.seed_tenants(self.env, tenants, **seed)
        self.started: list[harness.Child] = []
        self.port = harness.free_port()
        log = harness.RESULTS / f"bulk-{name}-api.log"
        self.api = self.start("api", harness.ApiServer().argv(HOST, self.port), log)
        harness.wait_for_http(HOST, self.port, self.api)
        self.url = f"http://{HOST}:{self.port}"
        # One keep-alive client: a fresh connection per poll cost ~2 ms of this process's CPU
        # per job line in the vllm phase, taken from the engine it measures on these 2 cores.
        self.http = httpx.Client()

    def start(self, name: str, argv: list[str], log: Path) -> harness.Child:
        child = harness.start_process(name, argv, self.env, log)
        self.started.append(child)
        return child

    def start_pacer(self, name: str) -> None:
        argv = [harness.PYTHON, "manage.py", "bulk_pacer"]
        self.start("pacer", argv, harness.RESULTS / f"bulk-{name}-pacer.log")

    def submit(self, tenant: str, lines: list[dict[str, Any]]) -> str:
        """Upload the lines and create their batch; returns the batch id."""
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        uploaded = httpx.post(
            f"{self.url}/v1/files", data={"purpose": "batch"}, headers=headers, timeout=120,
            files={"file": ("input.jsonl", data, "application/jsonl")},
        )  # fmt: skip
        uploaded.raise_for_status()
        body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions",
                "completion_window": "24h"}  # fmt: skip
        created = httpx.post(f"{self.url}/v1/batches", json=body, headers=headers, timeout=300)
        created.raise_for_status()
        return str(created.json()["id"])

    def batch(self, tenant: str, batch_id: str) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"}
        answer = self.http.get(f"{self.url}/v1/batches/{batch_id}", headers=headers, timeout=30)
        answer.raise_for_status()
        return dict(answer.json())

    def completed_at(self, batch_id: str) -> float:
        """When the job completed by the server's own record (epoch seconds, to the µs): a job's
        end no longer waits on this client's next poll, which can then be rare."""
        script = (
            "from llmqueue.models import BulkJob; "
            f"print(BulkJob.objects.get(pk={batch_id!r}).completed_at.timestamp())"
        )
        done = subprocess.run(
            [harness.PYTHON, "manage.py", "shell", "-c", script], cwd=harness.REPO,
            env=self.env, capture_output=True, text=True, check=True, timeout=120,
        )  # fmt: skip
        return float(done.stdout.strip().splitlines()[-1])

    def wait_completed(
        self, tenant: str, batch_id: str, timeout: float, poll_s: float = 0.2
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            batch = self.batch(tenant, batch_id)
            if batch["status"] not in ("validating", "in_progress", "finalizing"):
                if batch["status"] != "completed" or batch["request_counts"]["failed"]:
                    raise RuntimeError(f"batch {batch_id} ended {batch['status']}: {batch}")
                return batch
            if time.monotonic() > deadline:
                raise TimeoutError(f"batch {batch_id} still {batch['status']}")
            for child in self.started:
                if not child.running():
                    raise RuntimeError(f"{child.name} exited: {child.log_tail()}")
            time.sleep(poll_s)

    def close(self) -> None:
        self.http.close()
        for child in reversed(self.started):
            harness.stop_process(child)
        harness.flush_redis(self.redis_url)
        self.database.cleanup()


def completion_line(custom_id: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its descendants (granian's workers), in MiB."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            with open(f"/proc/{current}/status") as status:
                for row in status:
                    if row.startswith("VmRSS:"):
                        total += int(row.split()[1])
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    pending += [int(c) for c in children.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total / 1024


def peak_rss_while(pid: int, work: Any) -> tuple[Any, float]:
    """Run `work()` while sampling the process tree's RSS every 20 ms; returns its result and
    the peak in MiB."""
    peak, stop = [tree_rss_mb(pid)], threading.Event()

    def sample() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], tree_rss_mb(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return work(), peak[0]
    finally:
        stop.set()
        sampler.join()


def enqueue_phase(args: argparse.Namespace) -> dict[str, Any]:
    phase = Phase("enqueue", [{"name": "bulk", "tier": "batch", "limits": NO_LIMIT}])
    try:
        lines = [completion_line(f"line-{i}", SIM_MODEL, f"prompt {i}: {'lorem ' * (i % 40)}", 16)
                 for i in range(args.lines)]  # fmt: skip
        idle_mb = tree_rss_mb(phase.api.pid)
        start = time.perf_counter()
        batch_id, peak_mb = peak_rss_while(phase.api.pid, lambda: phase.submit("bulk", lines))
        elapsed = time.perf_counter() - start
        batch = phase.batch("bulk", batch_id)
        if batch["status"] != "in_progress" or batch["request_counts"]["total"] != args.lines:
            raise RuntimeError(f"the batch was not accepted whole: {batch}")
        return {"lines": args.lines, "enqueue_10k_s": elapsed if args.lines == 10_000 else None,
                "enqueue_s": elapsed, "web_idle_rss_mb": round(idle_mb, 1),
                "web_peak_rss_mb": round(peak_mb, 1)}  # fmt: skip
    finally:
        phase.close()


class InteractiveLoad:
    """One short interactive request every `interval` seconds (202, background) until stopped;
    the ids of what it sent."""

    def __init__(self, phase: Phase, interval: float = 0.5) -> None:
        self.url = f"{phase.url}/v1/completions"
        self.headers = {"Authorization": f"Bearer {phase.keys['interactive']}"}
        self.interval, self.refused = interval, 0
        self.ids: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        body = {"model": VLLM_MODEL, "prompt": "How long is the queue?", "max_tokens": 16,
                "background": True}  # fmt: skip
        with httpx.Client(timeout=30) as client:
            next_at = time.monotonic()
            while not self.stop.is_set():
                answer = client.post(self.url, json=body, headers=self.headers)
                if answer.status_code == 202:
                    self.ids.append(answer.json()["id"])
                else:
                    self.refused += 1
                next_at += self.interval
                self.stop.wait(max(0.0, next_at - time.monotonic()))

    def during(self, work: Any) -> Any:
        self.thread.start()
        try:
            return work()
        finally:
            self.stop.set()
            self.thread.join()


def first_token_waits_ms(
    timeline: dict[str, dict[str, Any]], ids: list[str], start: str = "enqueued"
) -> list[float]:
    """Each request's wait in ms from `start` (its enqueue, or "started": its claim) to its
    first token."""
    rows = [timeline[i] for i in ids if i in timeline]
    return [1000 * (r["first_token"] - r[start]) for r in rows if r["first_token"] and r[start]]


def wait_split_ms(timeline: dict[str, dict[str, Any]], ids: list[str]) -> dict[str, float]:
    """p50 and p99 of the wait's two parts: enqueue → claim (the message in Redis, Celery's
    fetch, the claim's DB write) and claim → first token (the engine: parked, waiting, prefill)."""
    total = first_token_waits_ms(timeline, ids)
    engine = first_token_waits_ms(timeline, ids, start="started")
    rows = [timeline[i] for i in ids if i in timeline and timeline[i]["started"]]
    fetch = [1000 * (r["started"] - r["enqueued"]) for r in rows]
    return {f"{name}_p{q}": round(percentile(values, q), 1)
            for name, values in (("total", total), ("enqueue_to_claim", fetch),
                                 ("claim_to_first_token", engine))
            for q in (50, 99)}  # fmt: skip


def vllm_phase(args: argparse.Namespace) -> dict[str, Any]:
    tenants = [{"name": "bulk", "tier": "batch", "limits": NO_LIMIT},
               {"name": "interactive", "tier": "interactive", "limits": NO_LIMIT}]  # fmt: skip
    phase = Phase("vllm", tenants, model=VLLM_MODEL, pool=VLLM_POOL, max_tokens=args.max_tokens)
    direct = None
    try:
        phase.start("worker", vllm_worker_argv(args), harness.RESULTS / "bulk-vllm-worker.log")
        harness.wait_for_workers(phase.redis_url, VLLM_POOL, 1, phase.started, 600)
        phase.start_pacer("vllm")
        direct = DirectRunner(args)
        # Warm-up: one job of a slot's worth, so the worker's threads are set up before the clock.
        warm = [completion_line(f"w{i}", VLLM_MODEL, p, args.max_tokens)
                for i, p in enumerate(prompts(task_slots(args)))]  # fmt: skip
        phase.wait_completed("bulk", phase.submit("bulk", warm), 600)
        idle = InteractiveLoad(phase, args.interactive_interval)
        idle.during(lambda: time.sleep(args.interactive_seconds))
        direct_run = direct.run()
        direct_s, direct_steps = direct_run["direct_s"], direct_run["direct_steps"]
        lines = [completion_line(f"line-{i}", VLLM_MODEL, p, args.max_tokens)
                 for i, p in enumerate(prompts(args.job_lines))]  # fmt: skip

        def job() -> tuple[float, str]:
            start = time.time()
            batch_id = phase.submit("bulk", lines)
            phase.wait_completed("bulk", batch_id, 1800, poll_s=1.0)
            return start, batch_id

        def job_seconds(run: tuple[float, str]) -> float:
            # Read once the interactive tenant has stopped: the lookup starts a Django process,
            # whose second of CPU on these 2 cores starved the engine while the last interactive
            # requests waited (steps of one request took 70-140 ms; the bench's, not the job's).
            start, batch_id = run
            return phase.completed_at(batch_id) - start

        # The ratio is the job's alone, right after the direct run: the stack's cost. Then the
        # same job again with the interactive tenant beside it, for its waits (its headroom
        # costs the job throughput: shown as ratio_with_interactive).
        steps_before = engine_steps(phase.redis_url, time.time())
        cpu_before = cpu_snapshot(phase.started, phase.redis_url)
        alone = job()
        cpu_after = cpu_snapshot(phase.started, phase.redis_url)
        job_s = job_seconds(alone)
        job_steps = engine_steps(phase.redis_url, time.time()) - steps_before
        busy = InteractiveLoad(phase, args.interactive_interval)
        steps_before = engine_steps(phase.redis_url, time.time())
        busy_job_s = job_seconds(busy.during(job))
        busy_job_steps = engine_steps(phase.redis_url, time.time()) - steps_before
        timeline = harness.request_timeline(phase.env)
        idle_ms = first_token_waits_ms(timeline, idle.ids)
        busy_ms = first_token_waits_ms(timeline, busy.ids)
        p99_idle, p99_busy = percentile(idle_ms, 99), percentile(busy_ms, 99)
        return {
            "job_lines": args.job_lines, "max_tokens": args.max_tokens,
            "direct_s": direct_s, "job_s": job_s, "ratio": direct_s / job_s,
            # Engine steps for the job and for the direct run: the part of the ratio that
            # machine noise does not move.
            "job_steps": job_steps, "direct_steps": direct_steps,
            "job_with_interactive_s": busy_job_s, "ratio_with_interactive": direct_s / busy_job_s,
            "job_with_interactive_steps": busy_job_steps,
            # Where the machine's CPU went during the job, per line: every ms outside the worker's
            # engine is taken from it on these 2 cores (the pacer, the API, this client's polls).
            "cpu_ms_per_line": cpu_per_request(cpu_before, cpu_after, args.job_lines),
            "busy_cores_during_job": busy_cores(cpu_before, cpu_after, job_s),
            "interactive_p99_ms_idle": round(p99_idle, 1),
            "interactive_p99_ms_during_bulk": round(p99_busy, 1),
            "interactive_p99_during_vs_idle": round(p99_busy / p99_idle, 2),
            "interactive_p50_ms_idle": round(percentile(idle_ms, 50), 1),
            "interactive_p50_ms_during_bulk": round(percentile(busy_ms, 50), 1),
            "interactive_wait_split_ms": {"idle": wait_split_ms(timeline, idle.ids),
                                          "during_bulk": wait_split_ms(timeline, busy.ids)},
            "interactive_requests": {"idle": len(idle_ms), "during_bulk": len(busy_ms),
                                     "refused": idle.refused + busy.refused},
            "engine": engine_flags(args),
        }  # fmt: skip
    finally:
        if direct is not None:
            direct.close()
        phase.close()


def engine_steps(redis_url: str, after: float) -> int:
    """The vLLM worker's engine steps as of its first beat after `after`."""
    client = redis.Redis.from_url(redis_url)
    try:
        # The worker beats at LLMQUEUE_WORKER_HEARTBEAT_SECONDS' default, 2 s.
        stats = beat_after(client, VLLM_POOL, after, timeout_s=30.0, beat_s=2.0)
    finally:
        client.close()
    return sum(int(s["engine"]["steps"]) for s in stats.values())


def service_gap(
    rows: list[dict[str, Any]], tenants: tuple[str, str], since: float, at: str = "enqueued"
) -> float:
    """The largest difference in tokens served to the two tenants from `since`, while both still
    had lines not served (the bound's premise: both backlogged). A line is served at `at`:
    "enqueued", when the pacer released it (its enqueued_at: the fair scheduler's own decision,
    what the VTC bound is about), or "started", when a worker claimed it (at delivery: the lines
    released before `since` then still count for the first tenant).

    The difference is taken after each instant, not after each line: the pacer releases a
    tick's lines together (one UPDATE stamps them all with the same enqueued_at, one pipeline
    publishes them), so within a release they have no order. Ordering them anyway (by the
    table's order: one tenant's eight lines, then the other's) counted 5-10 × the largest
    request between two tenants the scheduler had served within one request of each other."""
    first, second = tenants
    both_until = min(max(r[at] for r in rows if r["tenant"] == t) for t in tenants)
    served = {first: 0.0, second: 0.0}
    gap = 0.0
    ordered = sorted((r for r in rows if since <= r[at] < both_until), key=lambda r: r[at])
    for _, together in itertools.groupby(ordered, key=lambda r: r[at]):
        for row in together:
            served[row["tenant"]] += row["prompt_tokens"] + row["completion_tokens"]
        gap = max(gap, abs(served[first] - served[second]))
    return gap


def fairness_phase(args: argparse.Namespace) -> dict[str, Any]:
    big, small = args.fair_lines
    tenants = [{"name": name, "tier": "batch", "limits": NO_LIMIT} for name in ("big", "small")]
    # A shallow tier: the pacer keeps at most 16 lines waiting, so its choice of tenant decides.
    phase = Phase("fairness", tenants, tiers={"batch": {"max_queue_depth": 32}})
    try:
        argv = harness.worker_argv(model=SIM_MODEL, pool=SIM_POOL, time_scale=1.0, max_num_seqs=16)
        phase.start("worker", argv, harness.RESULTS / "bulk-fairness-worker.log")
        harness.wait_for_workers(phase.redis_url, SIM_POOL, 1, phase.started, 120)
        phase.start_pacer("fairness")
        rng = random.Random(1)

        def lines(n: int) -> list[dict[str, Any]]:
            return [completion_line(f"l{i}", SIM_MODEL, "word " * rng.randint(4, 60),
                                    rng.randint(8, 96)) for i in range(n)]  # fmt: skip

        first = phase.submit("big", lines(big))
        time.sleep(args.fair_delay)
        # Counted from the second job's creation: while its file uploads and its lines are
        # validated and stored, only the first tenant has lines the pacer may release. Timed
        # from before the upload (up to 7af47a0), a slower machine's longer upload let one of
        # the pacer's releases of the first tenant alone (16 lines here) count as unfairness.
        submitting = time.time()
        second = phase.submit("small", lines(small))
        since = time.time()
        phase.wait_completed("small", second, 600)
        phase.wait_completed("big", first, 1800)
        rows = [r for r in harness.request_timeline(phase.env).values() if r["started"]]
        largest = max(r["prompt_tokens"] + r["completion_tokens"] for r in rows)
        gap = service_gap(rows, ("big", "small"), since)
        claimed_gap = service_gap(rows, ("big", "small"), since, at="started")
        return {"fair_lines": [big, small], "fairness_gap_tokens": gap,
                "largest_request_tokens": largest,
                "fairness_gap_vs_largest": round(gap / largest, 2),
                "fairness_gap_at_claim_tokens": claimed_gap,
                "second_job_submit_s": round(since - submitting, 3)}  # fmt: skip
    finally:
        phase.close()


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lines", type=int, default=10_000, help="lines of the enqueue phase")
    parser.add_argument("--job-lines", type=int, default=1000, help="lines of the vLLM job")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--interactive-seconds", type=float, default=20.0)
    parser.add_argument(
        "--interactive-interval",
        type=float,
        default=0.1,
        help="seconds between the interactive tenant's requests, idle and during the job",
    )
    parser.add_argument(
        "--fair-lines", type=lambda text: [int(v) for v in text.split(",")], default=[2000, 200]
    )
    parser.add_argument("--fair-delay", type=float, default=10.0)
    parser.add_argument("--phases", default="enqueue,vllm,fairness")
    parser.add_argument("--model-path", default="")
    parser.add_argument(
        "--engine-core",
        choices=["thread", "child"],
        default="thread",
        help="the vLLM worker's engine on its engine thread, or in a process of its own "
        "(--engine-process); LLM.generate stays in-process",
    )
    add_bulk_slot_arguments(parser)
    parser.add_argument("--out", default=str(harness.RESULTS / "bulk.json"))
    args = parser.parse_args(argv)
    # What bench.throughput's worker and direct child read.
    args.prompts, args.slots = args.job_lines, 0
    args.stack_cpu_threads = 0
    return args


def report(result: dict[str, Any]) -> str:
    out = []
    if "enqueue_s" in result:
        out.append(f"{result['lines']} lines accepted and stored in {result['enqueue_s']:.2f} s "
                   f"(goal ≤ {GOALS['enqueue_10k_s']} s for 10k), web peak RSS "
                   f"{result['web_peak_rss_mb']} MiB")  # fmt: skip
    if "ratio" in result:
        out.append(f"{result['job_lines']}-line job {result['job_s']:.1f} s vs LLM.generate "
                   f"{result['direct_s']:.1f} s: ratio {result['ratio']:.3f} (goal ≥ 0.85); "
                   f"interactive first-token p99 {result['interactive_p99_ms_idle']} ms idle, "
                   f"{result['interactive_p99_ms_during_bulk']} ms during the job "
                   f"(× {result['interactive_p99_during_vs_idle']}, goal ≤ 2)")  # fmt: skip
    if "fairness_gap_tokens" in result:
        out.append(f"fairness gap {result['fairness_gap_tokens']:.0f} tokens, largest request "
                   f"{result['largest_request_tokens']} (× {result['fairness_gap_vs_largest']}, "
                   "goal ≤ 4)")  # fmt: skip
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    harness.exit_on_sigterm()
    phases = args.phases.split(",")
    result: dict[str, Any] = {}
    if "enqueue" in phases:
        result.update(enqueue_phase(args))
    if "vllm" in phases:
        args.model_path = harness.tiny_model_path(args.model_path)
        result.update(vllm_phase(args))
    if "fairness" in phases:
        result.update(fairness_phase(args))
    result.update(
        goals=GOALS,
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        date=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    harness.write_result(Path(args.out), result, report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
