"""Added latency of one request through the whole path, open loop at a fixed rate, zero engine time.

    .venv/bin/python -m bench.latency [--rate 20] [--duration 60] [--max-tokens 1]

HTTP in → auth/validation/admission → DB row → Celery/Redis → simulated worker (step time 0) →
result backend → HTTP out, against the API served by granian (WSGI; `--server gunicorn` for the
other) and one `workers.serve` process, with their own DB (temporary SQLite, or database
`llmqueue_bench_latency` when $DATABASE_URL names a PostgreSQL server) and their own Redis db.
Writes bench/results/latency.json and prints it, with a split of each latency by the row's own
timestamps (enqueued_at, started_at, finished_at) and the CPU each process spent per request.
Exit status 1 when any request failed (an invalid run).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis as redis_client

from bench import harness
from bench.http_client import HttpError, RawConnection, ThreadConnections, encode_request

HOST = "127.0.0.1"
GOAL_P50_MS = 5.0
GOAL_P99_MS = 15.0
POOL = "default"
MODEL = "sim"
# Celery's INFO line for a finished task: "Task llmqueue.generate[<id>] succeeded in 0.0012s: …"
_SUCCEEDED = re.compile(r"Task llmqueue\.generate\[([0-9a-f-]+)\] succeeded in ([0-9.e-]+)s")


@dataclass
class Sample:
    """One request as the client saw it (perf_counter seconds) and the id the server gave it."""

    scheduled: float
    started: float
    ended: float
    status: int  # 0: no HTTP response (connection error, timeout)
    error: str = ""
    request_id: str = ""
    sent_wall: float = 0.0  # time.time() at send start, to line up with the server's timeline
    ended_wall: float = 0.0

    @property
    def latency_ms(self) -> float:
        return (self.ended - self.started) * 1000.0

    @property
    def lag_ms(self) -> float:
        return (self.started - self.scheduled) * 1000.0


class LoadClient:
    """Sends completion requests over per-thread keep-alive connections (like an SDK's pool),
    with the lean client of bench/http_client.py so its own cost stays out of the latency."""

    def __init__(self, port: int, api_key: str, body: dict[str, Any], path: str, timeout_s: float):
        self.port, self.timeout_s = port, timeout_s
        headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.request = encode_request(
            "POST", f"{HOST}:{port}", path, headers, json.dumps(body).encode()
        )
        # Connected outside the measured interval: a pooled client has it open already.
        self._connections = ThreadConnections(HOST, port, timeout_s)
        self._lock = threading.Lock()
        self.reconnects = 0

    def _exchange(self, conn: RawConnection) -> tuple[int, bytes, str]:
        response = conn.exchange(self.request)
        return response.status, response.body, response.headers.get("x-llmqueue-request-id", "")

    def send(self, scheduled: float) -> Sample:
        conn = self._connections.get()
        wall = time.time()
        started = time.perf_counter()
        try:
            try:
                status, data, request_id = self._exchange(conn)
            except (HttpError, ConnectionResetError, BrokenPipeError):
                # The server closed an idle keep-alive connection: reconnect, measure afresh.
                with self._lock:
                    self.reconnects += 1
                conn = self._connections.get(fresh=True)
                wall = time.time()
                started = time.perf_counter()
                status, data, request_id = self._exchange(conn)
        except OSError as exc:
            self._connections.forget()
            return Sample(
                scheduled, started, time.perf_counter(), 0, f"{type(exc).__name__}: {exc}"
            )
        ended = time.perf_counter()
        error = (
            "" if status == 200 and b'"choices"' in data else data[:200].decode(errors="replace")
        )
        return Sample(scheduled, started, ended, status, error, request_id, wall, time.time())

    def close(self) -> None:
        self._connections.close()


def run_open_loop(
    client: LoadClient, rate: float, count: int, max_seconds: float, threads: int
) -> list[Sample]:
    """Send `count` requests at fixed intervals of 1/rate s, each on a pool thread so a slow
    response never delays the next send (open loop). Stops scheduling after `max_seconds`."""
    interval = 1.0 / rate
    futures: list[Future[Sample]] = []
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="load") as pool:
        start = time.perf_counter() + 0.05
        for i in range(count):
            scheduled = start + i * interval
            if scheduled - start > max_seconds:
                break
            delay = scheduled - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            futures.append(pool.submit(client.send, scheduled))
    # Leaving the pool waited for every send; each is bounded by the socket timeout. A send that
    # found all threads busy started late: Sample.lag_ms shows it (max_send_lag_ms).
    return [f.result() for f in futures]


# --- statistics --------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), numpy's default method."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        "p50_ms": round(percentile(values, 50), 3),
        "p90_ms": round(percentile(values, 90), 3),
        "p99_ms": round(percentile(values, 99), 3),
        "mean_ms": round(statistics.fmean(values), 3),
        "min_ms": round(min(values), 3),
        "max_ms": round(max(values), 3),
    }


def server_breakdown(
    samples: list[Sample], timeline: dict[str, dict[str, Any]], worker_task_s: dict[str, float]
) -> dict[str, dict[str, float]]:
    """Split each client latency with the row's timestamps (same host, same wall clock):
    send → enqueued_at (HTTP in, Django, auth, validation), enqueued_at → started_at (insert,
    commit, publish, broker, Celery delivery, the worker's claim), started_at → finished_at
    (engine, recorder), finished_at → response read (result store + publish, pubsub wake-up,
    response), and Celery's own "succeeded in" time when the worker logged at INFO."""
    parts: dict[str, list[float]] = {
        "http_in_to_enqueue": [],
        "enqueue_to_claim": [],
        "claim_to_finish": [],
        "finish_to_response": [],
    }
    worker: list[float] = []
    for sample in samples:
        row = timeline.get(sample.request_id)
        if not row or row["started"] is None or row["finished"] is None:
            continue
        parts["http_in_to_enqueue"].append((row["enqueued"] - sample.sent_wall) * 1000)
        parts["enqueue_to_claim"].append((row["started"] - row["enqueued"]) * 1000)
        parts["claim_to_finish"].append((row["finished"] - row["started"]) * 1000)
        parts["finish_to_response"].append((sample.ended_wall - row["finished"]) * 1000)
        if sample.request_id in worker_task_s:
            worker.append(worker_task_s[sample.request_id] * 1000)
    out = {name: summary_ms(values) for name, values in parts.items() if values}
    if worker:
        out["celery_task_succeeded_in"] = summary_ms(worker)
    return out


def worker_task_times(log_path: Path | None) -> dict[str, float]:
    if log_path is None or not log_path.exists():
        return {}
    text = log_path.read_text(errors="replace")
    return {m.group(1): float(m.group(2)) for m in _SUCCEEDED.finditer(text)}


def cpu_snapshot(started: list[harness.Child], redis_url: str) -> dict[str, float]:
    """CPU seconds used so far by each child, this load generator, and the Redis server (shared
    with other users: an upper bound for our share)."""
    times = os.times()
    snapshot = {child.name: harness.cpu_seconds(child.pid) for child in started}
    snapshot["load_generator"] = times.user + times.system
    snapshot["machine"] = harness.machine_busy_seconds()
    client = redis_client.Redis.from_url(redis_url)
    try:
        info = client.info("cpu")
        snapshot["redis_server_shared"] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    finally:
        client.close()
    return snapshot


def cpu_per_request(
    before: dict[str, float], after: dict[str, float], requests: int
) -> dict[str, float]:
    used = {name: after[name] - before[name] for name in before}
    machine = used.pop("machine")
    ours = sum(v for k, v in used.items() if k != "redis_server_shared")
    out = {name: round(v * 1000 / max(1, requests), 3) for name, v in used.items()}
    # What the rest of the machine burned meanwhile (other users, PostgreSQL, the kernel):
    # the measurement is only comparable between runs where this stays small.
    out["everything_else"] = round((machine - ours) * 1000 / max(1, requests), 3)
    return out


def busy_cores(before: dict[str, float], after: dict[str, float], seconds: float) -> float:
    return round((after["machine"] - before["machine"]) / max(seconds, 1e-9), 2)


# --- the run -----------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.latency", description=__doc__)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of measured load")
    parser.add_argument("--warmup", type=int, default=20, help="requests sent first, not counted")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--prompt", default="Say hello.")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--client-threads", type=int, default=16, help="load generator threads")
    parser.add_argument("--request-timeout", type=float, default=30.0, help="seconds per request")
    parser.add_argument("--server", choices=["granian", "gunicorn"], default="granian")
    parser.add_argument("--worker-class", default="gthread", help="gunicorn worker class")
    parser.add_argument("--api-workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=8, help="gunicorn threads per worker")
    parser.add_argument("--gunicorn-config", default="", help="extra gunicorn config file")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument(
        "--worker-loglevel",
        default="WARNING",
        help="INFO also reports Celery's per-task 'succeeded in' time (costs a log line per task)",
    )
    parser.add_argument("--redis-db", type=int, default=6, help="Redis db number, flushed")
    parser.add_argument(
        "--database-url", default=None, help="override $DATABASE_URL (postgres://… or sqlite:///…)"
    )
    parser.add_argument("--db-name", default="llmqueue_bench_latency", help="PostgreSQL database")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "latency.json")
    parser.add_argument("--label", default="", help="free text stored with the result")
    return parser.parse_args(argv)


def _body(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    common = {"model": MODEL, "max_tokens": args.max_tokens}
    if args.endpoint == "chat":
        messages = [{"role": "user", "content": args.prompt}]
        return "/v1/chat/completions", {**common, "messages": messages}
    return "/v1/completions", {**common, "prompt": args.prompt}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    redis = harness.redis_url(args.redis_db)
    database = harness.bench_database(args.db_name, args.database_url)
    server = harness.ApiServer(
        args.server, args.worker_class, args.api_workers, args.threads,
        config=args.gunicorn_config,
    )  # fmt: skip
    harness.flush_redis(redis)
    try:
        env = harness.bench_env(database, redis)
        harness.migrate(env)
        # Limits far above the offered load: this measures latency, not admission rejections.
        limits = {"requests_per_second": 10_000.0, "burst": 10_000, "tokens_per_minute": 10**9}
        api_key = harness.seed(env, model=MODEL, pool=POOL, limits=limits)
        port = harness.free_port()
        worker_log = harness.RESULTS / "latency-worker.log"
        with harness.children() as started:
            worker_argv = harness.worker_argv(
                model=MODEL,
                pool=POOL,
                time_scale=0.0,
                max_num_seqs=args.max_num_seqs,
                loglevel=args.worker_loglevel,
            )
            started.append(harness.start_process("worker", worker_argv, env, worker_log))
            api_log = harness.RESULTS / "latency-api.log"
            started.append(harness.start_process("api", server.argv(HOST, port), env, api_log))
            harness.wait_for_workers(redis, POOL, 1, started)
            harness.wait_for_http(HOST, port, started[-1])

            path, body = _body(args)
            client = LoadClient(port, api_key, body, path, args.request_timeout)
            try:
                warm = run_open_loop(client, args.rate, args.warmup, 60.0, args.client_threads)
                count = max(1, round(args.rate * args.duration))
                cpu_before = cpu_snapshot(started, redis)
                t0 = time.perf_counter()
                samples = run_open_loop(
                    client, args.rate, count, args.duration, args.client_threads
                )
                elapsed = time.perf_counter() - t0
                cpu_after = cpu_snapshot(started, redis)
                cpu = cpu_per_request(cpu_before, cpu_after, len(samples))
                machine_cores = busy_cores(cpu_before, cpu_after, elapsed)
            finally:
                client.close()
            for child in started:
                if not child.running():
                    raise RuntimeError(f"{child.name} died during the run:\n{child.log_tail()}")
        timeline = harness.request_timeline(env)
    finally:
        harness.flush_redis(redis)
        database.cleanup()

    ok = [s for s in samples if s.status == 200 and not s.error]
    latencies = [s.latency_ms for s in ok]
    statuses = Counter(str(s.status) for s in samples)
    errors = [s.error for s in samples if s.error][:5]
    stats = summary_ms(latencies)
    result: dict[str, Any] = {
        "p50_ms": stats.get("p50_ms"),
        "p99_ms": stats.get("p99_ms"),
        "requests": len(samples),
        **{k: v for k, v in stats.items() if k not in ("p50_ms", "p99_ms")},
        "ok": len(ok),
        "errors": len(samples) - len(ok),
        "status_counts": dict(statuses),
        "error_examples": errors,
        "valid": len(ok) == len(samples) == count and bool(samples),
        "goal": {"p50_ms": GOAL_P50_MS, "p99_ms": GOAL_P99_MS},
        "goal_met": bool(latencies)
        and stats["p50_ms"] <= GOAL_P50_MS
        and stats["p99_ms"] <= GOAL_P99_MS,
        "rate_per_s": args.rate,
        "achieved_rate_per_s": round(len(samples) / elapsed, 2) if elapsed else None,
        "duration_s": args.duration,
        "elapsed_s": round(elapsed, 2),
        "warmup_requests": len(warm),
        "warmup_errors": sum(1 for s in warm if s.status != 200 or s.error),
        "max_send_lag_ms": round(max((s.lag_ms for s in samples), default=0.0), 3),
        "client_reconnects": client.reconnects,
        "cpu_ms_per_request": cpu,
        "machine": {
            "cores": os.cpu_count(),
            "busy_cores_during_run": machine_cores,
            "loadavg_after": list(os.getloadavg()),
        },
        "breakdown": server_breakdown(ok, timeline, worker_task_times(worker_log)),
        "config": {
            "path": path,
            "max_tokens": args.max_tokens,
            "prompt_chars": len(args.prompt),
            "api": server.describe(),
            "client": f"bench/http_client.py keep-alive, {args.client_threads} threads, open loop",
            "worker": " ".join(worker_argv[1:]),
            "database": database.kind,
            "redis": redis,
            "label": args.label,
        },
    }
    return result


def report(result: dict[str, Any]) -> str:
    api = result["config"]["api"]
    lines = [
        f"latency over {result['requests']} requests at {result['rate_per_s']:g}/s "
        f"({result['config']['database']}, {api['server']} "
        f"{api['workers']} workers x {api['threads']} threads):",
        f"  p50 {result['p50_ms']} ms  p90 {result.get('p90_ms')} ms  p99 {result['p99_ms']} ms  "
        f"mean {result.get('mean_ms')} ms  max {result.get('max_ms')} ms",
        f"  status {result['status_counts']}  valid={result['valid']}  "
        f"goal (p50≤{GOAL_P50_MS:g}, p99≤{GOAL_P99_MS:g}) met={result['goal_met']}",
    ]
    cpu = ", ".join(f"{k} {v:g}" for k, v in result["cpu_ms_per_request"].items())
    lines.append(f"  CPU ms per request: {cpu}")
    machine = result["machine"]
    lines.append(
        f"  machine: {machine['busy_cores_during_run']} of {machine['cores']} cores busy during "
        f"the run, load average {machine['loadavg_after'][0]:.2f}"
    )
    for name, part in result["breakdown"].items():
        lines.append(f"  {name:26s} p50 {part['p50_ms']:8.3f}  p99 {part['p99_ms']:8.3f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    harness.exit_on_sigterm()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = measure(args)
    harness.write_result(args.out, result, report(result))
    return 0 if result["valid"] else 1


if __name__ == "__main__":
    sys.exit(main())
