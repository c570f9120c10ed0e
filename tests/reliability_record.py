"""Figures a fault test hands to bench/reliability.py: one JSON line per scenario, when asked."""

from __future__ import annotations

import json
import os
from pathlib import Path

# bench/reliability.py runs the fault tests with this set and reads the lines back; a plain
# `make test` leaves it unset and records nothing.
OUT_ENV = "LLMQUEUE_RELIABILITY_OUT"


def record(scenario: str, **figures: float | int | str) -> None:
    """Append `{"scenario": …, **figures}` to the file named by $LLMQUEUE_RELIABILITY_OUT."""
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    with Path(out).open("a", encoding="utf-8") as f:
        f.write(json.dumps({"scenario": scenario, **figures}) + "\n")
