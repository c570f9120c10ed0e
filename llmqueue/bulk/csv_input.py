"""A CSV of prompts → batch line objects, so a CSV row is validated exactly as a JSONL line is.

The first row names the columns: `prompt` is required; `custom_id`, `model`, `system` (chat
only: a system message before the prompt) and the sampling fields in COLUMNS are optional.
Each row becomes `{"custom_id", "method": "POST", "url": <endpoint>, "body"}`, the line the
Batch API takes, and then goes through llmqueue/bulk/lines.py like any JSONL line. Numbers are
passed on as numbers when they read as one, else as the text, which the body's validation then
refuses with its own message. A row is numbered by the file line it starts on (the header is
line 1), and an empty `custom_id` becomes `line-<that number>`.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from typing import Any

from llmqueue.bulk.lines import LineError, LineInvalid

CHAT = "/v1/chat/completions"
NUMBER_COLUMNS = frozenset(
    {"max_tokens", "temperature", "top_p", "top_k", "seed", "min_tokens", "presence_penalty",
     "frequency_penalty"}
)  # fmt: skip
TEXT_COLUMNS = frozenset({"custom_id", "model", "prompt", "system", "stop", "user"})
COLUMNS = NUMBER_COLUMNS | TEXT_COLUMNS

Row = dict[str, str]


def csv_rows(data: bytes) -> tuple[list[tuple[int, Row]], list[LineError]]:
    """The file's rows by column name, each with the line it starts on; or the reason the file
    cannot be read as a CSV of prompts (its header, its encoding, a malformed row)."""
    try:
        text = data.decode("utf-8-sig")  # spreadsheets often save a byte order mark
    except UnicodeDecodeError as exc:
        return [], [LineError("invalid_csv", f"The file is not UTF-8 text: {exc}.")]
    reader = csv.reader(io.StringIO(text, newline=""))
    rows: list[tuple[int, Row]] = []
    start = 1
    try:
        header = [name.strip() for name in next(reader, [])]
        problem = header_problem(header)
        if problem:
            return [], [LineError("invalid_csv_header", problem, 1)]
        start = reader.line_num + 1
        for cells in reader:
            if any(cell.strip() for cell in cells):
                rows.append((start, row_cells(header, cells)))
            start = reader.line_num + 1
    except csv.Error as exc:
        return [], [LineError("invalid_csv", f"The file is not a valid CSV: {exc}.", start)]
    return rows, []


def header_problem(header: list[str]) -> str | None:
    if not any(header):
        return "The first row must name the columns; `prompt` is required."
    unknown = [name for name in header if name not in COLUMNS]
    if unknown:
        return f"Unknown column {unknown[0]!r}; the columns are: {', '.join(sorted(COLUMNS))}."
    if len(set(header)) < len(header):
        return "A column is named twice."
    if "prompt" not in header:
        return "The `prompt` column is required."
    return None


def row_cells(header: list[str], cells: list[str]) -> Row:
    if len(cells) > len(header):
        # Kept for row_line to refuse with the row's number, beside the other rows' errors.
        return {"": f"{len(cells)} values for {len(header)} columns"}
    return dict(zip(header, cells, strict=False))


def row_decoder(endpoint: str, model: str | None) -> Callable[[tuple[int, Row]], dict[str, Any]]:
    """The decode step for lines.parse_entries: a numbered row → its line object."""

    def decode(numbered: tuple[int, Row]) -> dict[str, Any]:
        number, row = numbered
        return row_line(row, number, endpoint, model)

    return decode


def row_line(row: Row, number: int, endpoint: str, model: str | None) -> dict[str, Any]:
    """One row as the Batch API's line object; `model` is used where the row names none."""
    if "" in row:
        raise LineInvalid("invalid_csv_row", f"The row has {row['']}.")
    prompt = row.get("prompt", "")
    if not prompt.strip():
        raise LineInvalid("missing_prompt", "The `prompt` column is empty.", "prompt")
    body: dict[str, Any] = {}
    if row.get("model", "").strip() or model:
        body["model"] = row.get("model", "").strip() or model
    system = row.get("system", "")
    if endpoint == CHAT:
        messages = [{"role": "system", "content": system}] if system.strip() else []
        body["messages"] = [*messages, {"role": "user", "content": prompt}]
    elif system.strip():
        raise LineInvalid("invalid_csv_row", "`system` is for chat completions only.", "system")
    else:
        body["prompt"] = prompt
    for name in sorted(NUMBER_COLUMNS & row.keys()):
        if row[name].strip():
            body[name] = number_or_text(row[name].strip())
    for name in ("stop", "user"):
        if row.get(name, ""):
            body[name] = row[name]
    custom_id = row.get("custom_id", "").strip() or f"line-{number}"
    return {"custom_id": custom_id, "method": "POST", "url": endpoint, "body": body}


def number_or_text(value: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            continue
    return value
