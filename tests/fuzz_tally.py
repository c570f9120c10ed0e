"""How many requests the property and fuzz tests generated, by kind: printed after the run."""

from __future__ import annotations

from collections import Counter

GENERATED: Counter[str] = Counter()


def count_generated(kind: str) -> None:
    GENERATED[kind] += 1
