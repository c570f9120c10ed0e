"""bench.suite: each bench's figures from its JSON, and a suite run over stand-in benches."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import suite


def test_figures_read_what_each_bench_writes_and_say_missing_otherwise():
    throughput = {"by_chunk_size": {"8": {"ratio": 0.93}, "1": {"ratio": 0.8}}}
    assert [(f.value, f.met) for f in suite.throughput_figures(throughput)] == [
        (0.93, True),
        (0.8, False),
    ]
    assert [f.met for f in suite.headroom_figures({"p99_wait_steps": 2})] == [True]
    admission = {"goal": {"admitted_rps": 400.0, "reject_p99_ms": 10.0}, "admitted_rps": 599.0}
    assert [(f.name, f.op, f.met) for f in suite.admission_figures(admission)] == [
        ("admitted_rps", ">=", True),
        ("reject_p99_ms", "<=", None),
    ]
    for figures in (suite.throughput_figures, suite.latency_figures, suite.scheduling_figures):
        assert all(f.value is None and f.met is None for f in figures({"unrelated": 1}))


def test_scheduling_reports_the_worst_seed_of_a_sweep():
    def run(attainment: float) -> dict[str, Any]:
        ours = {"interactive_slo_attainment": attainment, "batch_throughput_vs_fifo": 1.0}
        return {"ours": {"1.2": ours}}

    figures = suite.scheduling_figures({"by_seed": {"1": run(1.0), "2": run(0.97)}, **run(1.0)})
    assert (figures[0].name, figures[0].value, figures[0].met) == (
        "ours at 1.2×: interactive SLO attainment, worst of 2 seeds",
        0.97,
        False,
    )
    assert suite.scheduling_figures(run(0.995))[0].met is True


def test_every_bench_runs_with_its_out_flag_and_quick_forms_differ_from_full():
    names = [bench.name for bench in suite.BENCHES]
    assert names == ["throughput", "throughput_engine_process", "queue_cost", "latency", "headroom",
                     "headroom_engine_process", "scheduling", "scheduling_sweep", "admission",
                     "deadlines",
                     "metrics_overhead", "bulk", "bulk_engine_process", "overload",
                     "reliability"]  # fmt: skip
    # Every module under bench/ that writes a result is one of them.
    writers = {
        path.stem
        for path in (Path(suite.REPO) / "bench").glob("*.py")
        if '"--out"' in path.read_text() and path.stem not in ("suite", "render", "compare")
    }
    assert writers == {bench.module_name for bench in suite.BENCHES}
    for bench in suite.BENCHES:
        argv = bench.argv(full=False, python="py")
        assert argv[:3] == ["py", "-m", f"bench.{bench.module_name}"]
        assert argv[-2:] == ["--out", f"bench/results/{bench.name}.json"]
        assert bench.quick != bench.full
    # A second layout of one module: its full form is the module's defaults plus the layout.
    layout = suite.BY_NAME["throughput_engine_process"]
    assert layout.argv(full=True, python="py") == [
        "py", "-m", "bench.throughput", "--engine-core", "child", "--bulk-reserve", "-1",
        "--out", "bench/results/throughput_engine_process.json",
    ]  # fmt: skip
    assert all(not bench.full for bench in suite.BENCHES if not bench.module)
    # Its bulk layout: only the phase that runs the worker's engine, and only its figures.
    bulk = suite.BY_NAME["bulk_engine_process"]
    assert bulk.argv(full=True, python="py")[3:-2] == ["--phases", "vllm", "--engine-core", "child"]
    figures = bulk.figures({"ratio": 0.8, "interactive_p99_during_vs_idle": 1.5})
    assert [(f.value, f.met) for f in figures] == [(0.8, False), (1.5, True)]


STAND_IN = """\
import json, sys
from pathlib import Path

out = Path(sys.argv[sys.argv.index("--out") + 1])
if "--no-json" not in sys.argv:
    out.write_text(json.dumps({"p50_ms": 4.0, "p99_ms": 30.0}))
sys.exit(3 if "--fail" in sys.argv else 0)
"""


def test_a_failed_bench_is_reported_and_the_rest_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # Stand-in benches under a repository of the test's own: `-m bench.<name>` runs them there.
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    for name in ("good", "broken", "silent"):
        (tmp_path / "bench" / f"{name}.py").write_text(STAND_IN)
    stale = tmp_path / "bench" / "results" / "silent.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"p50_ms": 1.0, "p99_ms": 1.0}))
    monkeypatch.setattr(suite, "REPO", tmp_path)
    benches = [
        suite.Bench("good", ("--quick",), (), suite.latency_figures),
        suite.Bench("broken", ("--fail",), (), suite.latency_figures),
        suite.Bench("silent", ("--no-json",), (), suite.latency_figures),
    ]

    result = suite.run_suite(benches, full=False, python=sys.executable, timeout_s=60)

    entries = result["benches"]
    assert [(name, e["status"], e["returncode"]) for name, e in entries.items()] == [
        ("good", "ok", 0),
        ("broken", "failed", 3),
        ("silent", "ok", 0),
    ]
    assert [f["met"] for f in entries["good"]["figures"]] == [True, False]
    # A failed bench that still wrote its JSON keeps its figures; the row says it failed.
    assert [f["value"] for f in entries["broken"]["figures"]] == [4.0, 30.0]
    # An older file the run did not rewrite gives nothing, not its stale figures.
    assert [f["value"] for f in entries["silent"]["figures"]] == [None, None]
    assert entries["silent"]["json_sha256"] is None
    assert entries["good"]["command"].endswith(
        "-m bench.good --quick --out bench/results/good.json"
    )
    assert result["form"] == "quick"
    rows = suite.summary_rows(result)
    assert ("broken (failed: exit 3)", "p99 ms", "30", "≤ 15", "no") in rows
    assert ("silent", "p50 ms", "missing", "≤ 5", "missing") in rows


def test_a_partial_run_keeps_the_other_benches_with_the_commit_that_measured_them():
    earlier = {
        "commit": "aaa1111", "dirty": False, "date": "2026-12-01 10:00 UTC", "form": "quick",
        "benches": {"latency": {"status": "ok", "figures": []},
                    "throughput": {"status": "failed", "figures": []}},
    }  # fmt: skip
    now = {"commit": "bbb2222", "dirty": False, "date": "2026-12-02 10:00 UTC", "form": "quick",
           "benches": {"throughput": {"status": "ok", "figures": [], "commit": "bbb2222",
                                      "dirty": False, "date": "2026-12-02 10:00 UTC"}}}  # fmt: skip
    merged = suite.with_earlier(now, earlier)
    assert list(merged["benches"]) == ["throughput", "latency"]  # the suite's order
    assert merged["benches"]["throughput"]["status"] == "ok"
    assert merged["benches"]["latency"]["commit"] == "aaa1111"
    label = suite.bench_label("latency", merged["benches"]["latency"], merged)
    assert label == "latency (commit aaa1111, 2026-12-01 10:00 UTC)"
    assert suite.bench_label("throughput", merged["benches"]["throughput"], merged) == "throughput"


def test_the_bulk_fairness_gap_is_taken_after_each_release_not_inside_one():
    from bench.bulk import service_gap

    def line(tenant: str, at: float, tokens: int) -> dict[str, Any]:
        return {"tenant": tenant, "enqueued": at, "prompt_tokens": tokens, "completion_tokens": 0}

    # Two releases of one line each per tenant, then a release of big's alone, then small's.
    rows = [line("big", 1.0, 100), line("small", 1.0, 90), line("big", 2.0, 80),
            line("small", 2.0, 100), line("big", 3.0, 50), line("small", 4.0, 10)]  # fmt: skip
    # After 1.0: 100 vs 90; after 2.0: 180 vs 190; after 3.0 (small still waits): 230 vs 190.
    assert service_gap(rows, ("big", "small"), since=0.5) == 10  # both until 3.0 (big's last)
    rows.append(line("big", 5.0, 1))
    assert service_gap(rows, ("big", "small"), since=0.5) == 40
