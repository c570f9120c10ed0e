"""Overload: ten times the engine's capacity for a minute, against the floor of this machine.

    .venv/bin/python -m bench.overload [--seconds 60] [--multiple 10] [--quick]

The real stack on its own DB (temporary SQLite, or database `llmqueue_bench_overload` when
$DATABASE_URL names a PostgreSQL server) and Redis db: the API under granian (2 processes, 8
threads each, as bench/admission.py), one `workers.serve` with the simulated GPU engine at real
speed (`--max-num-seqs` sequences; a request of ~100 prompt and 48 output tokens takes ~0.4 s).

1. capacity: a backlog of the `probe` tenant's requests is drained; requests/s once the engine
   is full, as bench/deadlines.py measures it.
2. the burst, open loop for `--seconds`, `--multiple` × capacity in all, over keep-alive pools:
   - `flood`: 80% of it, a tenant with no rate limit: its tier's queue fills to its depth cap
     (`--depth-cap`) and the rest is refused 503 `queue_full`;
   - `capped`: 20%, a tenant limited to an eighth of the capacity, each request with a 2 s
     deadline: refused 429 over its rate, 503 `deadline_unreachable` when the wait is longer;
     what it gets admitted may expire, which must happen on time;
   - `floor`: `--floor-rps` GETs of /health, a Django view doing one Redis round trip (PING)
     on the same server, the same connections' kind, the same load: this machine's floor.
     An absolute rejection latency swung from 5 to 50 ms between two runs of the same code on
     these shared 2-core machines; its ratio to the floor measured beside it does not.
   Every 0.1 s a sampler reads the tier queue's length and the API's and worker's RSS (each
   process tree's VmRSS).
3. settle: every admitted request must end succeeded or expired, an expired one no later than
   its deadline + 2 sweep intervals + 1 s; none may be left queued or running (lost).

Figures: `reject_p99_ratio` (the p99 of every 429/503, client-side from its scheduled send, ÷
the floor's p99; goal ≤ 3), `depth_max_over_cap` (the queue's longest ÷ its cap; goal ≤ 1),
the RSS growth over the burst's last three quarters (goal ≤ 64 MB each: bounded, not growing
with the load's length), `server_errors` (any 5xx but a backpressure 503, or no answer; goal 0),
and the settled counts (`lost` 0, `expired_late` 0). Writes bench/results/overload.json.
Exit status 1 when a goal other than the latency ratio is missed (an incorrect run).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_client

from bench import harness
from bench.admission import Connection, Reply, by_kind, open_loop, run_client
from bench.deadlines import MODEL, completion_request
from bench.http_client import encode_request
from bench.latency import summary_ms
from workers import processes

HOST = "127.0.0.1"
POOL = "default"
TIER = "interactive"
QUEUE = f"{POOL}.{TIER}"
TIER_WAIT_S = 20
CAPPED_DEADLINE_S = 2.0
SWEEP_S = 1.0  # LLMQUEUE_DEADLINE_SWEEP_SECONDS's default, which the worker runs with
GOAL_REJECT_P99_RATIO = 3.0
GOAL_DEPTH_OVER_CAP = 1.0
GOAL_RSS_GROWTH_MB = 64.0
UNLIMITED = {"requests_per_second": 1e5, "burst": 10**5, "tokens_per_minute": 10**9}
REJECTIONS = (429, 503)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.overload", description=__doc__)
    parser.add_argument("--seconds", type=float, default=60.0, help="the burst's length")
    parser.add_argument("--multiple", type=float, default=10.0, help="× the measured capacity")
    parser.add_argument("--floor-rps", type=float, default=50.0, help="GET /health per second")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--depth-cap", type=int, default=16, help="the tier's max_queue_depth")
    parser.add_argument("--quick", action="store_true", help="a 20 s burst")
    parser.add_argument("--redis-db", type=int, default=4, help="Redis db number, flushed")
    parser.add_argument(
        "--database-url", default=None, help="override $DATABASE_URL (postgres://… or sqlite:///…)"
    )
    parser.add_argument("--db-name", default="llmqueue_bench_overload", help="PostgreSQL database")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "overload.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 20.0
    return args


# --- requests ------------------------------------------------------------------------------------
def health(port: int) -> bytes:
    return encode_request("GET", f"{HOST}:{port}", "/health", {}, b"")


# --- the stack -----------------------------------------------------------------------------------
@dataclass
class Serving:
    env: dict[str, str]
    port: int
    keys: dict[str, str]
    redis: str
    api: harness.Child
    worker: harness.Child


def seed(env: dict[str, str], args: argparse.Namespace, capacity_hint: float) -> dict[str, str]:
    capped = {
        # An eighth: its requests reach the rate check only while the queue has room, and at
        # half the capacity that left its bucket unspent in some 10 s runs (no 429 at all).
        "requests_per_second": capacity_hint / 8,
        "burst": max(1, round(capacity_hint / 8)),
        "tokens_per_minute": 10**9,
    }
    tenants = [
        {"name": "probe", "tier": TIER, "limits": UNLIMITED},
        {"name": "flood", "tier": TIER, "limits": UNLIMITED},
        {"name": "capped", "tier": TIER, "limits": capped},
    ]
    tiers = {TIER: {"max_wait_seconds": TIER_WAIT_S, "max_queue_depth": args.depth_cap}}
    return harness.seed_tenants(env, tenants, model=MODEL, pool=POOL, tiers=tiers)


def nominal_capacity(args: argparse.Namespace) -> float:
    """The capped tenant's rate is set before capacity is measured: the simulated engine's
    nominal rate (max-num-seqs sequences of ~0.4 s) is close enough for a limit."""
    return args.max_num_seqs / 0.4


@contextmanager
def serving(args: argparse.Namespace) -> Iterator[Serving]:
    redis = harness.redis_url(args.redis_db)
    database = harness.bench_database(args.db_name, args.database_url)
    harness.flush_redis(redis)
    try:
        env = harness.bench_env(database, redis)
        harness.migrate(env)
        keys = seed(env, args, nominal_capacity(args))
        port = harness.free_port()
        with harness.children() as started:
            worker_argv = harness.worker_argv(
                model=MODEL, pool=POOL, time_scale=1.0, max_num_seqs=args.max_num_seqs
            )
            worker_log = harness.RESULTS / "overload-worker.log"
            started.append(harness.start_process("worker", worker_argv, env, worker_log))
            api = harness.ApiServer("granian", workers=2, threads=8)
            api_log = harness.RESULTS / "overload-api.log"
            started.append(harness.start_process("api", api.argv(HOST, port), env, api_log))
            harness.wait_for_workers(redis, POOL, 1, started)
            harness.wait_for_http(HOST, port, started[-1])
            yield Serving(env, port, keys, redis, api=started[1], worker=started[0])
    finally:
        harness.flush_redis(redis)
        database.cleanup()


def rows_of(env: dict[str, str], tenants: set[str]) -> dict[str, dict[str, Any]]:
    return {k: r for k, r in harness.request_timeline(env).items() if r["tenant"] in tenants}


def wait_until_settled(
    env: dict[str, str], tenants: set[str], expected: int, timeout_s: float
) -> dict[str, dict[str, Any]]:
    """The tenants' rows once every one is finished, failed or expired (or the timeout passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = rows_of(env, tenants)
        still_open = sum(r["status"] in ("queued", "running") for r in found.values())
        if (len(found) >= expected and not still_open) or time.monotonic() > deadline:
            return found
        time.sleep(1)


def measure_capacity(serving: Serving, args: argparse.Namespace) -> float:
    """Requests/s the engine completes with a standing backlog (the probe tenant's rows). The
    backlog is sent one request at a time, each refusal waited out: admission sheds a fresh
    queue's burst on a drain rate it has barely measured yet."""
    backlog = 6 * args.max_num_seqs
    request = completion_request(serving.port, serving.keys["probe"])

    async def send_backlog() -> Counter[int]:
        answers: Counter[int] = Counter()
        conn = await Connection.open(serving.port)
        try:
            while answers[202] < backlog:
                reply = await conn.exchange("probe", request)
                answers[reply.status] += 1
                if reply.status != 202:
                    await asyncio.sleep(0.05)
        finally:
            conn.close()
        return answers

    answers = run_client(send_backlog(), "uvloop")
    if set(answers) - {202, 503}:
        raise RuntimeError(f"the capacity probe was answered {dict(answers)}")
    found = wait_until_settled(serving.env, {"probe"}, backlog, 120)
    finished = sorted(r["finished"] for r in found.values() if r["finished"] is not None)
    steady = finished[args.max_num_seqs :]  # the first engine-full started together
    return (len(steady) - 1) / (steady[-1] - steady[0])


# --- sampling ------------------------------------------------------------------------------------
def tree_rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its live descendants (granian's worker processes)."""
    total_kb = 0
    for member in processes.descendants(pid):
        try:
            status = Path(f"/proc/{member}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                total_kb += int(line.split()[1])
    return total_kb / 1024.0


@dataclass
class Sampler:
    """Every `interval_s`: (seconds since start, queue length, API RSS MB, worker RSS MB)."""

    serving: Serving
    interval_s: float = 0.1
    samples: list[tuple[float, int, float, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="overload-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        client = redis_client.Redis.from_url(self.serving.redis)
        t0 = time.perf_counter()
        try:
            while not self._stop.wait(self.interval_s):
                self.samples.append(
                    (
                        time.perf_counter() - t0,
                        int(client.llen(QUEUE)),
                        tree_rss_mb(self.serving.api.pid),
                        tree_rss_mb(self.serving.worker.pid),
                    )
                )
        finally:
            client.close()


def rss_growth_mb(samples: list[tuple[float, int, float, float]], column: int) -> float:
    """Peak RSS over the burst's last three quarters minus the RSS a quarter in: memory that
    grows with the load's length, not the working set a burst needs at once."""
    if not samples:
        return 0.0
    end = samples[-1][0]
    quarter = [s[column] for s in samples if s[0] <= end / 4] or [samples[0][column]]
    later = [s[column] for s in samples if s[0] > end / 4] or [samples[-1][column]]
    return round(max(later) - quarter[-1], 1)


# --- the burst -----------------------------------------------------------------------------------
def burst(serving: Serving, args: argparse.Namespace, capacity: float) -> dict[str, Any]:
    offered = args.multiple * capacity
    streams = [
        ("flood", completion_request(serving.port, serving.keys["flood"]), 0.8 * offered, 32),
        (
            "capped",
            completion_request(serving.port, serving.keys["capped"], CAPPED_DEADLINE_S),
            0.2 * offered,
            8,
        ),
        ("floor", health(serving.port), args.floor_rps, 8),
    ]
    sampler = Sampler(serving)
    sampler.start()
    try:
        load = open_loop(serving.port, streams, args.seconds)
        replies, elapsed, lags = run_client(load, "uvloop")
    finally:
        sampler.stop()
    if not serving.api.running() or not serving.worker.running():
        raise RuntimeError("the API or the worker died during the burst")
    return {"replies": replies, "elapsed": elapsed, "lags": lags, "samples": sampler.samples}


def admitted_count(replies: list[Reply]) -> int:
    return sum(r.status == 202 for r in replies)


def settled_counts(found: dict[str, dict[str, Any]], admitted: int) -> dict[str, int]:
    statuses = Counter(r["status"] for r in found.values())
    late = [
        r
        for r in found.values()
        if r["status"] == "expired"
        and r["finished"] is not None
        and r["finished"] > r["deadline"] + 2 * SWEEP_S + 1.0
    ]
    return {
        "admitted": admitted,
        "stored": len(found),
        "succeeded": statuses.get("succeeded", 0),
        "expired": statuses.get("expired", 0),
        "failed": statuses.get("failed", 0),
        "lost": statuses.get("queued", 0) + statuses.get("running", 0) + admitted - len(found),
        "expired_late": len(late),
    }


def server_errors(replies: list[Reply]) -> Counter[str]:
    """Answers that are not the API's own: no answer, a 5xx other than backpressure's 503, a
    rejection without Retry-After, a floor probe that was not 200."""
    wrong: Counter[str] = Counter()
    for reply in replies:
        if reply.status == 0 or (reply.status >= 500 and reply.status != 503):
            wrong[f"{reply.kind}:{reply.status}"] += 1
        elif reply.kind == "floor" and reply.status != 200:
            wrong[f"floor:{reply.status}"] += 1
        elif reply.status in REJECTIONS and not reply.retry_after.isdigit():
            wrong[f"{reply.kind}:{reply.status} without Retry-After"] += 1
    return wrong


def summarise(
    args: argparse.Namespace,
    capacity: float,
    run: dict[str, Any],
    found: dict[str, dict[str, Any]],
    messages_left: int,
) -> dict[str, Any]:
    replies: list[Reply] = run["replies"]
    samples = run["samples"]
    rejected = [r.latency_ms for r in replies if r.kind != "floor" and r.status in REJECTIONS]
    floor = [r.latency_ms for r in by_kind(replies, "floor") if r.status == 200]
    reject, floor_stats = summary_ms(rejected), summary_ms(floor)
    ratio = reject["p99_ms"] / floor_stats["p99_ms"] if rejected and floor else float("nan")
    depth_max = max((s[1] for s in samples), default=0)
    counts = settled_counts(found, admitted_count(replies))
    errors = server_errors(replies)
    growth = {"api": rss_growth_mb(samples, 2), "worker": rss_growth_mb(samples, 3)}
    correct = (
        not errors
        and depth_max <= args.depth_cap
        and counts["lost"] == 0
        and counts["expired_late"] == 0
        and counts["stored"] == counts["admitted"]
        and messages_left == 0
        and all(g <= GOAL_RSS_GROWTH_MB for g in growth.values())
    )
    return {
        "reject_p99_ratio": round(ratio, 3),
        "depth_max_over_cap": round(depth_max / args.depth_cap, 3),
        "reject_p99_ms": reject.get("p99_ms"),
        "floor_p99_ms": floor_stats.get("p99_ms"),
        "goal": {
            "reject_p99_ratio": GOAL_REJECT_P99_RATIO,
            "depth_max_over_cap": GOAL_DEPTH_OVER_CAP,
            "rss_growth_mb": GOAL_RSS_GROWTH_MB,
            "server_errors": 0,
            "lost": 0,
            "expired_late": 0,
        },
        "goal_met": correct and ratio <= GOAL_REJECT_P99_RATIO,
        "correct": correct,
        "server_errors": sum(errors.values()),
        "unexpected": dict(errors),
        "capacity_rps": round(capacity, 2),
        "offered_rps": round(args.multiple * capacity, 1),
        "burst_s": round(run["elapsed"], 2),
        "answers": {
            kind: dict(Counter(str(r.status) for r in by_kind(replies, kind)))
            for kind in ("flood", "capped", "floor")
        },
        "latency": {
            "rejections": reject,
            "floor": floor_stats,
            "admitted": summary_ms([r.latency_ms for r in replies if r.status == 202]),
        },
        **run["lags"],
        "depth": {"cap": args.depth_cap, "max": depth_max, "samples": len(samples)},
        "rss_mb": {
            "api_peak": round(max((s[2] for s in samples), default=0.0), 1),
            "worker_peak": round(max((s[3] for s in samples), default=0.0), 1),
            "api_growth": growth["api"],
            "worker_growth": growth["worker"],
        },
        "settled": counts,
        "broker_messages_left": messages_left,
        "config": {
            "seconds": args.seconds,
            "multiple": args.multiple,
            "floor_rps": args.floor_rps,
            "max_num_seqs": args.max_num_seqs,
            "tier_wait_s": TIER_WAIT_S,
            "capped_deadline_s": CAPPED_DEADLINE_S,
            "api": "granian, 2 processes × 8 threads",
            "engine": "simulated at real speed (time scale 1.0)",
        },
    }


def broker_messages(url: str) -> int:
    """Messages still waiting in the tier's queue or delivered and not acked."""
    client = redis_client.Redis.from_url(url)
    try:
        return int(client.llen(QUEUE)) + int(client.hlen("unacked"))
    finally:
        client.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with serving(args) as stack:
        capacity = measure_capacity(stack, args)
        run = burst(stack, args, capacity)
        admitted = admitted_count(run["replies"])
        found = wait_until_settled(stack.env, {"flood", "capped"}, admitted, TIER_WAIT_S + 60)
        messages_left = broker_messages(stack.redis)
    return summarise(args, capacity, run, found, messages_left)


def report(result: dict[str, Any]) -> str:
    settled, rss = result["settled"], result["rss_mb"]
    return "\n".join(
        [
            f"overload: {result['offered_rps']}/s offered ({result['config']['multiple']:g}× "
            f"capacity {result['capacity_rps']}/s) for {result['burst_s']} s; "
            f"goal met={result['goal_met']} correct={result['correct']}",
            f"  rejections p99 {result['reject_p99_ms']} ms ÷ floor (GET /health) p99 "
            f"{result['floor_p99_ms']} ms = {result['reject_p99_ratio']} (goal ≤ "
            f"{GOAL_REJECT_P99_RATIO:g})",
            f"  queue depth max {result['depth']['max']} of cap {result['depth']['cap']}; "
            f"RSS peak api {rss['api_peak']} MB worker {rss['worker_peak']} MB, growth "
            f"{rss['api_growth']} / {rss['worker_growth']} MB",
            f"  answers {result['answers']}",
            f"  admitted {settled['admitted']}: succeeded {settled['succeeded']}, expired "
            f"{settled['expired']} ({settled['expired_late']} late), failed {settled['failed']}, "
            f"lost {settled['lost']}; server errors {result['server_errors']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    harness.exit_on_sigterm()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = measure(args)
    harness.write_result(args.out, result, report(result))
    return 0 if result["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
