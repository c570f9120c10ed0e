"""Which code may import which: development tooling stays out of the product."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def importers(folder: str, forbidden: tuple[str, ...]) -> dict[str, set[str]]:
    """{file: the forbidden modules it imports} under `folder`."""
    found = {}
    for path in sorted((REPO / folder).rglob("*.py")):
        bad = {m for m in imported_modules(path) if m.split(".")[0] in forbidden}
        if bad:
            found[str(path.relative_to(REPO))] = bad
    return found


def test_the_product_does_not_import_development_tooling():
    for folder in ("llmqueue", "workers", "project"):
        assert importers(folder, ("devtools", "bench", "tests")) == {}


def test_the_api_sides_commands_import_no_worker_code():
    assert importers("llmqueue/management", ("workers", "devtools")) == {}


def test_the_process_supervisor_and_worker_command_builder_stand_alone():
    for name in ("processes.py", "command.py"):
        modules = imported_modules(REPO / "workers" / name)
        assert not {m for m in modules if m.split(".")[0] in ("django", "llmqueue", "project")}
