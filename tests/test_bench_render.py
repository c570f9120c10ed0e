"""bench.suite's figures and bench.render's page from a small synthetic suite: no bench runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import render, suite


def synthetic_suite() -> dict[str, Any]:
    latency = suite.latency_figures({"p50_ms": 4.867, "p99_ms": 21.5})
    return {
        "commit": "abc1234",
        "dirty": True,
        "date": "2026-12-04 10:00 UTC",
        "machine": "x86_64 (test CPU), 2 cores",
        "versions": {"celery": "5.7.0"},
        "database": "sqlite",
        "form": "quick",
        "benches": {
            "latency": {
                "command": ".venv/bin/python -m bench.latency --duration 20 "
                "--out bench/results/latency.json",
                "json_path": "bench/results/latency.json",
                "status": "ok",
                "returncode": 0,
                "seconds": 41.0,
                "json_sha256": None,
                "log": "bench/results/latency.log",
                "figures": [figure.to_json() for figure in latency],
            },
            "deadlines": {
                "command": ".venv/bin/python -m bench.deadlines --quick "
                "--out bench/results/deadlines.json",
                "json_path": "bench/results/deadlines.json",
                "status": "failed",
                "returncode": 1,
                "seconds": 3.0,
                "json_sha256": None,
                "log": "bench/results/deadlines.log",
                "figures": [figure.to_json() for figure in suite.deadlines_figures({})],
            },
        },
    }


def test_summary_rows_for_a_met_an_unmet_and_a_missing_figure():
    assert render.summary_table(synthetic_suite()) == [
        "| bench | figure | value | goal | met |",
        "| --- | --- | --- | --- | --- |",
        "| latency | p50 ms | 4.867 | ≤ 5 | yes |",
        "| latency | p99 ms | 21.5 | ≤ 15 | no |",
        "| deadlines (failed: exit 1) | mixed-1.1, EDF: urgent met deadline | missing | ≥ 0.99 "
        "| missing |",
    ]


def test_the_page_has_the_do_not_edit_header_the_run_line_and_a_section_per_bench():
    page = render.render(synthetic_suite(), {"latency": ({"p50_ms": 4.867}, "")})
    lines = page.splitlines()
    assert lines[0] == render.GENERATED
    assert "**Do not edit it by hand**" in page
    assert (
        "Run: commit abc1234+dirty, 2026-12-04 10:00 UTC, quick form; machine: x86_64 (test CPU), "
        "2 cores. Software: celery 5.7.0; database sqlite (each bench's own below, where it says)."
    ) in lines
    assert "## Added latency of the whole path — `bench/latency.py`" in lines
    assert (
        ".venv/bin/python -m bench.latency --duration 20 --out bench/results/latency.json" in lines
    )
    # Keys the bench's JSON lacks are dashes, not a crash.
    assert "| — | — | 4.867 | — | — | — | — / — |" in lines
    assert "Results (`bench/results/deadlines.json`): **Failed** (exit 1; log " in page
    assert "No result." in lines


def test_a_bench_measured_on_another_database_says_so_in_its_label_and_section():
    run = synthetic_suite()
    latency = run["benches"]["latency"]
    latency.update(commit="abc1234", dirty=True, date="2026-12-04 10:00 UTC", form="quick")
    latency["database"] = "postgresql"
    assert render.summary_table(run)[2] == "| latency (postgresql) | p50 ms | 4.867 | ≤ 5 | yes |"
    section = render.bench_section("latency", latency, {"p50_ms": 4.867})
    assert (
        "Results (`bench/results/latency.json`): Ran in 41 s on commit abc1234+dirty, "
        "2026-12-04 10:00 UTC, quick form, database postgresql."
    ) in section
    latency["database"] = "sqlite"  # the run's own: nothing added
    assert render.summary_table(run)[2] == "| latency | p50 ms | 4.867 | ≤ 5 | yes |"


def test_a_bench_json_rewritten_after_the_suite_is_left_out(tmp_path: Path):
    result = tmp_path / "bench" / "results" / "latency.json"
    result.parent.mkdir(parents=True)
    result.write_text(json.dumps({"p50_ms": 4.0}))
    entry = {"json_path": "bench/results/latency.json", "json_sha256": suite.sha256(result)}
    assert render.bench_json(entry, tmp_path) == ({"p50_ms": 4.0}, "")
    result.write_text(json.dumps({"p50_ms": 9.0}))
    data, note = render.bench_json(entry, tmp_path)
    assert data is None and "changed after the suite wrote it" in note
    assert render.bench_json({"json_sha256": None}, tmp_path) == (None, "This run wrote no result.")


def test_a_side_by_side_comparison_shows_both_commits_medians_and_runs():
    from bench import compare

    runs = {
        "latency": {
            "before": [{"p50 ms": 6.0, "p99 ms": 12.0}, {"p50 ms": 8.0, "p99 ms": 14.0}],
            "after": [{"p50 ms": 7.0, "p99 ms": None}, {"p50 ms": 5.0, "p99 ms": 11.0}],
        }
    }
    figures = compare.figures_table(runs)
    assert [(r["figure"], r["before"], r["after"]) for r in figures] == [
        ("p50 ms", 7.0, 6.0),
        ("p99 ms", 13.0, 11.0),
    ]
    page = render.render(
        synthetic_suite(),
        {},
        [
            {
                "title": "restructure",
                "commits": {"before": "aaaaaaa111", "after": "bbbbbbb222"},
                "repeats": 2,
                "command": "python -m bench.compare --before aaaaaaa",
                "figures": figures,
            }
        ],
    )
    assert "## Side by side: restructure" in page
    assert "| latency | p50 ms | 7 | 6 | 6, 8; 7, 5 |" in page
    assert "before (aaaaaaa)" in page and "after (bbbbbbb)" in page


def test_the_reliability_doc_gets_one_row_per_fault_between_its_markers():
    data = {
        "form": "quick",
        "scenarios": {
            "sigkill": {"passed": True, "test": "tests/x.py::test_kill"},
            "fuzz": {"passed": False, "test": "tests/y.py::test_fuzz"},
        },
        "sigkill": {"accepted": 12, "completed": 12, "lost": 0, "duplicated": 0,
                    "recovery_s": 3.03},
        "fuzz": {"requests": 2000, "server_errors": 0},
    }  # fmt: skip
    entry = {"commit": "abc1234", "date": "2026-12-06 07:00 UTC", "command": "py -m x"}
    doc = f"before\n{render.RELIABILITY_START}\nold\n{render.RELIABILITY_END}\nafter\n"
    text = render.with_block(doc, render.reliability_block(entry, data))
    assert text.startswith(f"before\n{render.RELIABILITY_START}\n") and text.endswith("after\n")
    assert "old" not in text
    assert (
        "| sigkill | passed | 12 | 12 | 0 | 0 | 3.03 | "
        "`.venv/bin/python -m bench.reliability --only sigkill` |"
    ) in text
    assert "| fuzz | **failed** | 2000 |" in text
    assert "Measured on commit abc1234, 2026-12-06 07:00 UTC, quick form" in text
