"""Every test the docs cite by name exists: `tests/<file>.py::test_<name>`, a cited test file, and
a bare `test_<name>` in backticks next to a cited file."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FILE_REF = re.compile(r"\btests/([\w/]+\.py)(?:::(\w+))?")
BARE_NAME = re.compile(r"`(test_\w+)`")


def documents(repo: Path = REPO) -> list[Path]:
    return [*sorted((repo / "docs").glob("*.md")), repo / "README.md"]


@cache
def defined_tests(path: Path) -> frozenset[str]:
    """Test functions a file defines at module level or in a class (parsed, never imported)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in tree.body:
        bodies = node.body if isinstance(node, ast.ClassDef) else [node]
        names.update(
            child.name
            for child in bodies
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
        )
    return frozenset(names)


def passages(text: str) -> list[str]:
    """Paragraphs, except that each table row stands alone: a row's file names its own tests."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if lines and all(line.lstrip().startswith("|") for line in lines):
            out.extend(lines)
        else:
            out.append(block)
    return out


def broken_references(text: str, source: str, repo: Path = REPO) -> list[str]:
    problems = []
    for passage in passages(text):
        files = []
        for match in FILE_REF.finditer(passage):
            relative, name = match.groups()
            path = repo / "tests" / relative
            if not path.is_file():
                problems.append(f"{source}: tests/{relative} does not exist")
                continue
            files.append(path)
            if name is not None and name not in defined_tests(path):
                problems.append(f"{source}: tests/{relative} defines no {name}")
        # A name cited without its file must be in a file its passage cites, else anywhere.
        candidates = files or sorted((repo / "tests").glob("**/test_*.py"))
        for match in BARE_NAME.finditer(FILE_REF.sub("", passage)):
            name = match.group(1)
            if not any(name in defined_tests(path) for path in candidates):
                where = ", ".join(f"tests/{p.relative_to(repo / 'tests')}" for p in files)
                problems.append(f"{source}: no test {name} in {where or 'tests/'}")
    return problems


def test_every_test_the_docs_name_exists():
    problems = []
    for doc in documents():
        problems += broken_references(doc.read_text(), str(doc.relative_to(REPO)))
    assert problems == []


def test_a_wrong_reference_is_reported(tmp_path: Path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "def test_real():\n    pass\n\n\n"
        "class TestGroup:\n    def test_method(self):\n        pass\n"
    )
    text = (
        "Shown by `tests/test_x.py::test_real` and `tests/test_x.py::test_method`.\n\n"
        "Renamed: `tests/test_x.py::test_old_name`; gone: `tests/test_gone.py`.\n\n"
        "| fault | `tests/test_x.py`, `test_real` and `test_bare_missing` |\n"
    )
    assert broken_references(text, "doc.md", tmp_path) == [
        "doc.md: tests/test_x.py defines no test_old_name",
        "doc.md: tests/test_gone.py does not exist",
        "doc.md: no test test_bare_missing in tests/test_x.py",
    ]
