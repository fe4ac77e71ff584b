"""A run's metrics.csv (Lightning's CSVLogger) read back: its rows, numbers and steps, each metric's
history, with one sentence naming the cell when the file is damaged. What run folders (`runs`),
the studies and `compare` read a run's metrics with.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path


def metrics_rows(metrics_csv: Path) -> list[tuple[int, dict[str, str]]]:
    """The rows of a CSVLogger file with their line numbers; one sentence if it is damaged (a row
    with more cells than the header, bytes that are not text)."""
    try:
        with open(metrics_csv, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            rows = [(reader.line_num, row) for row in reader]
    except (csv.Error, UnicodeDecodeError) as error:
        raise _damaged(metrics_csv, f"it cannot be read as CSV ({error})") from None
    for line, row in rows:
        if None in row:
            raise _damaged(metrics_csv, f"line {line} has more cells than the header")
    return rows


def metric_number(value: str, metrics_csv: Path, line: int, key: str) -> float:
    """A cell of a CSVLogger file as a number; one sentence naming the cell if it is not one."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise _damaged(metrics_csv, f"line {line} has {key}={value!r}, which is not a number") from None


def metric_step(value: str | None, metrics_csv: Path, line: int) -> int:
    """The step column of a CSVLogger row (empty: 0); one sentence if it is not a step."""
    step = metric_number(value or 0, metrics_csv, line, "step")
    if not (0 <= step < math.inf and step == int(step)):
        raise _damaged(metrics_csv, f"line {line} has step={value!r}, which is not a step")
    return int(step)


def _damaged(metrics_csv: Path, problem: str) -> ValueError:
    return ValueError(
        f"The metrics file {metrics_csv} is damaged: {problem}; restore it from a copy, or leave "
        "this run out."
    )


def metric_columns(metrics_csv: Path) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) pairs, in file order, empty cells skipped."""
    columns: dict[str, list[tuple[int, float]]] = {}
    for line, row in metrics_rows(metrics_csv):
        step = metric_step(row.get("step"), metrics_csv, line)
        for key, value in row.items():
            if key != "step" and value not in ("", None):
                columns.setdefault(key, []).append((step, metric_number(value, metrics_csv, line, key)))
    return columns
