"""`nag-lightning study depth` runs every point, resumes without rerunning, and writes its outputs."""

from __future__ import annotations

import csv
from pathlib import Path

from nag_lightning.analysis.study import depth_study

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml")


def test_depth_study_writes_tables_and_figures_and_resumes(tmp_path):
    extra = ["--trainer.max_steps=3", "--trainer.val_check_interval=3",
             f"--data.cache_dir={tmp_path / 'cache'}"]
    rows = depth_study(recipe=DEBUG, out=str(tmp_path), depths=[1, 2], seeds=[1], extra=extra)
    assert [row["depth"] for row in rows] == [1, 2]
    for row in rows:
        assert row["nag_gain"] == row["prenorm_mean"] - row["nag_mean"]
    with (tmp_path / "depth.csv").open() as handle:
        runs = list(csv.DictReader(handle))
    assert {(r["residual"], r["depth"]) for r in runs} == {
        ("prenorm", "1"), ("nag", "1"), ("prenorm", "2"), ("nag", "2")
    }
    assert "| 2 |" in (tmp_path / "depth.md").read_text()
    for figure in ("depth.png", "norm_growth.png"):
        assert (tmp_path / figure).stat().st_size > 10_000
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/result.json")}
    assert len(stamps) == 4
    depth_study(recipe=DEBUG, out=str(tmp_path), depths=[1, 2], seeds=[1], extra=extra)
    assert stamps == {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/result.json")}
