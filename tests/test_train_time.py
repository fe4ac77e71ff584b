"""Time to quality beside FLOPs to quality: `FlopAccounting` keeps training seconds across a resume,
and `compare` and `study isoflop` put them beside training FLOPs, in tables and in a figure."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from nag_lightning.analysis.reports.compare import compare, markdown_table, summarize
from nag_lightning.analysis.studies.isoflop import plot_time


def write_metrics(run: Path, rows: list[dict[str, object]]) -> Path:
    """A CSVLogger-like metrics.csv: one row per dict, empty cells where a key is missing."""
    run.mkdir(parents=True)
    keys = ["step", *dict.fromkeys(k for r in rows for k in r if k != "step")]
    with (run / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    return run


def timed_run(run: Path, seconds_per_step: float) -> Path:
    """Ten steps of 1e9 training FLOPs, seconds logged every other step, val bpb at steps 4 and 9."""
    rows: list[dict[str, object]] = []
    for step in range(1, 10, 2):
        rows.append({"step": step, "flops/total": 1e9 * (step + 1), "flops/tokens": 64 * (step + 1),
                     "time/train_seconds": seconds_per_step * (step + 1)})
    rows += [{"step": 4, "val/bpb": 3.0}, {"step": 9, "val/bpb": 2.5}]
    return write_metrics(run, rows)


def test_compare_puts_training_seconds_beside_flops(tmp_path):
    fast = timed_run(tmp_path / "routed" / "version_0", 0.5)
    untimed = write_metrics(tmp_path / "old" / "version_0", [
        {"step": 9, "flops/total": 1e10, "flops/tokens": 640}, {"step": 9, "val/bpb": 2.6}])
    rows = compare([fast, untimed], tmp_path / "cmp")
    routed, old = rows
    assert routed.train_seconds == 5.0 and routed.training_flops == 1e10
    # a validation point's seconds come from the logged totals around its step: steps 3 and 5
    # hold 2.0 and 3.0 s, so step 4 is 2.5 s; step 9 was logged itself
    assert routed.time_curve == [(2.5, 3.0), (5.0, 2.5)]
    assert routed.curve == [(5e9, 3.0), (1e10, 2.5)]
    assert math.isnan(old.train_seconds) and old.time_curve == [] and old.curve
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| training seconds |" in table.splitlines()[0]
    assert "| 1e+10 | 5.0 |" in table and "| 1e+10 | - |" in table
    with (tmp_path / "cmp" / "compare.csv").open() as handle:
        cells = {r["run"]: r["train_seconds"] for r in csv.DictReader(handle)}
    assert cells == {"routed": "5.0", "old": ""}
    assert (tmp_path / "cmp" / "compare.png").stat().st_size > 10_000


def test_the_isoflop_time_figure_draws_runs_with_and_without_seconds(tmp_path):
    runs = {"nag": 1.0, "routed": 0.6}
    results = []
    for recipe, per_step in runs.items():
        s = summarize(timed_run(tmp_path / recipe / "version_0", per_step), recipe)
        results.append({"recipe": recipe, "seed": 1, **s.row(), "curve": s.curve, "time_curve": s.time_curve})
    old = summarize(write_metrics(tmp_path / "old" / "version_0", [
        {"step": 9, "flops/total": 1e10, "flops/tokens": 640}, {"step": 9, "val/bpb": 2.6}]), "old")
    results.append({"recipe": "old", "seed": 1, **old.row(), "curve": old.curve, "time_curve": old.time_curve})
    rows = [{"recipe": r["recipe"], "bpb_min": r["final_val_bpb"]} for r in results]
    path = plot_time(results, rows, tmp_path / "isoflop_time.png")
    assert path.stat().st_size > 10_000
    assert [r["train_seconds"] for r in results[:2]] == [10.0, 6.0]


def test_flop_accounting_keeps_its_seconds_in_checkpoints():
    from nag_lightning.callbacks.flops import FlopAccounting

    before = FlopAccounting()
    before._train_time = 12.5  # seconds this session has trained
    state = before.state_dict()
    assert state["train_seconds"] == 12.5
    resumed = FlopAccounting()
    resumed.load_state_dict(state)
    resumed._train_time = 2.0
    assert resumed.train_seconds == 14.5
    older = {k: v for k, v in state.items() if k != "train_seconds"}  # written before seconds were kept
    resumed.load_state_dict(older)
    assert resumed.saved_seconds == 0.0
    with pytest.raises(ValueError, match="train_seconds=-1.0, not a number of seconds"):
        resumed.load_state_dict({**state, "train_seconds": -1.0})


def test_markdown_shows_a_dash_for_runs_without_seconds(tmp_path):
    run = write_metrics(tmp_path / "r" / "version_0", [{"step": 0, "val/bpb": 4.0}])
    assert "| - | - | - |" in markdown_table([summarize(run, "r")])
