"""The fault suite's figures: each fault test once, what it accepted, completed, lost, ran twice.

    .venv/bin/python -m bench.reliability [--quick] [--only sigkill,overload]

The faults are the tests in tests/ (docs/RELIABILITY.md describes each): real Redis servers,
real Celery worker subprocesses, granian, the database of $DATABASE_URL (PostgreSQL in CI,
SQLite otherwise). This runs them with pytest and $LLMQUEUE_RELIABILITY_OUT set, so each test
writes the figures it measured and asserted (tests/reliability_record.py); a scenario whose
test failed is reported failed with no figures. Full form: the overload test's burst is the
issue's 60 s and the API fuzz sends 5,000 requests; quick: 20 s and 2,000 (the suite's own).
Writes bench/results/reliability.json:
`{"sigkill": {"accepted", "completed", "lost", "duplicated", "recovery_s"}, "sigterm": {…},
"partition": {…}, "redis_data_loss": {…}, "overload": {"reject_p99_ratio",
"depth_max_over_cap", …}, "fuzz": {"requests", "server_errors"}, …}`.
Exit status 1 when a test failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness

# scenario: the test that shows it (its pytest node id).
SCENARIOS = {
    "sigkill": "tests/test_crash_recovery.py::"
    "test_a_killed_workers_requests_restart_elsewhere_within_the_stale_window",
    "sigterm": "tests/test_crash_recovery.py::"
    "test_a_worker_stopped_for_a_deploy_hands_its_requests_over_at_once",
    "api_restart": "tests/test_api_restart.py::"
    "test_an_api_restarted_mid_load_loses_no_accepted_request[sigterm-new-process]",
    "api_reload": "tests/test_api_restart.py::"
    "test_an_api_restarted_mid_load_loses_no_accepted_request[sighup]",
    "partition": "tests/test_partition.py::"
    "test_a_worker_host_cut_off_from_redis_is_recovered_elsewhere_and_its_late_finishes_refused",
    "sentinel_failover": "tests/test_sentinel.py::"
    "test_a_failover_mid_load_loses_no_accepted_request",
    "redis_data_loss": "tests/test_bulk_durability.py::"
    "test_a_batch_survives_a_redis_restart_mid_job[without-its-data]",
    "overload": "tests/test_overload.py::"
    "test_ten_times_capacity_is_refused_fast_with_the_queue_capped_and_nothing_admitted_lost",
    "fuzz": "tests/test_fuzz_api.py::"
    "test_no_generated_request_gets_a_5xx_or_leaves_a_trace_when_refused",
}
FORMS = {  # the environment each form gives the tests
    "full": {"LLMQUEUE_OVERLOAD_SECONDS": "60", "LLMQUEUE_FUZZ_EXAMPLES": "5000"},
    "quick": {"LLMQUEUE_OVERLOAD_SECONDS": "20", "LLMQUEUE_FUZZ_EXAMPLES": "2000"},
}
# What every scenario must show; an absent figure is not checked.
ZERO = ("lost", "duplicated", "server_errors")
GOAL_DEPTH_OVER_CAP = 1.0
GOAL_REJECT_P99_RATIO = 3.0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.reliability", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a 20 s overload, 2,000 fuzzed")
    parser.add_argument("--only", default="", help="comma-separated scenarios")
    parser.add_argument("--redis-db", type=int, default=3, help="Redis db number, flushed")
    parser.add_argument("--out", type=Path, default=harness.RESULTS / "reliability.json")
    return parser.parse_args(argv)


def run_tests(node_ids: list[str], env: dict[str, str], log: Path) -> tuple[int, float]:
    """pytest over `node_ids`, its output appended to `log`: (exit status, seconds)."""
    started = time.monotonic()
    with log.open("a", encoding="utf-8") as out:
        done = subprocess.run(
            [harness.PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *node_ids],
            cwd=harness.REPO, env=env, stdout=out, stderr=subprocess.STDOUT, check=False,
        )  # fmt: skip
    return done.returncode, time.monotonic() - started


def read_records(path: Path) -> dict[str, dict[str, Any]]:
    """The last record of each scenario (a test records once, at its end, after its asserts)."""
    found: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            found[str(entry.pop("scenario"))] = entry
    return found


def checks(scenario: str, figures: dict[str, Any]) -> dict[str, bool]:
    out = {f"{name} = 0": figures[name] == 0 for name in ZERO if name in figures}
    if scenario == "overload":
        out["depth_max_over_cap ≤ 1"] = figures["depth_max_over_cap"] <= GOAL_DEPTH_OVER_CAP
        out["reject_p99_ratio ≤ 3"] = figures["reject_p99_ratio"] <= GOAL_REJECT_P99_RATIO
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    chosen = [s for s in args.only.split(",") if s] or list(SCENARIOS)
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios: {sorted(unknown)}; known: {sorted(SCENARIOS)}")
    form = "quick" if args.quick else "full"
    log = args.out.with_suffix(".log")
    log.write_text("")
    result: dict[str, Any] = {"form": form, "scenarios": {}}
    with tempfile.TemporaryDirectory(prefix="llmqueue-reliability-") as tmp:
        for scenario in chosen:
            out = Path(tmp) / f"{scenario}.jsonl"
            env = {
                **os.environ,
                **FORMS[form],
                "REDIS_URL": harness.redis_url(args.redis_db),
                "LLMQUEUE_RELIABILITY_OUT": str(out),
            }
            status, seconds = run_tests([SCENARIOS[scenario]], env, log)
            figures = read_records(out).get(scenario, {})
            passed = status == 0 and bool(figures)
            result[scenario] = figures
            result["scenarios"][scenario] = {
                "test": SCENARIOS[scenario],
                "passed": passed,
                "pytest_status": status,
                "seconds": round(seconds, 1),
                "checks": checks(scenario, figures) if passed else {},
            }
    result["all_passed"] = all(s["passed"] for s in result["scenarios"].values())
    result["goal_met"] = result["all_passed"] and all(
        all(s["checks"].values()) for s in result["scenarios"].values()
    )
    return result


def report(result: dict[str, Any]) -> str:
    lines = [f"reliability ({result['form']}): goal met={result['goal_met']}"]
    for scenario, run in result["scenarios"].items():
        figures = ", ".join(f"{k} {v}" for k, v in result[scenario].items())
        state = "passed" if run["passed"] else f"FAILED (pytest {run['pytest_status']})"
        lines.append(f"  {scenario:16s} {state} in {run['seconds']} s: {figures}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    harness.exit_on_sigterm()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    result = measure(args)
    harness.write_result(args.out, result, report(result))
    return 0 if result["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
