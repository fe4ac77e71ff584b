"""`nag-lightning study depth` runs every point, resumes without rerunning, and writes its outputs."""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nag_lightning.analysis import study
from nag_lightning.analysis.study import depth_study, fit_run, plot_norm_growth

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml")


class InProcess:
    """Stands in for `subprocess` in the study module: runs `python -m nag_lightning.cli ARGS` in
    this process, its output going where the child's would."""

    STDOUT = subprocess.STDOUT

    @staticmethod
    def run(command: list[str], stdout, stderr) -> subprocess.CompletedProcess:
        from nag_lightning.cli import main

        assert command[:3] == [sys.executable, "-m", "nag_lightning.cli"], command
        status = 0
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stdout):
            try:
                main(command[3:])
            except SystemExit as exit_:
                status = exit_.code if isinstance(exit_.code, int) else 1
        return subprocess.CompletedProcess(command, status)


@pytest.fixture(params=["in_process", pytest.param("own_process", marks=pytest.mark.slow)])
def launch(request, monkeypatch):
    """How a study launches its runs. Users get one process per run, which the slow suite checks; the
    default suite runs them in this process, saving the seconds each new process spends importing
    Lightning, and tests everything else the same (`test_fit_run_...` keeps one real child process)."""
    if request.param == "in_process":
        monkeypatch.setattr(study, "subprocess", InProcess)
    return request.param


def test_fit_run_trains_in_its_own_process_and_is_not_run_twice(tmp_path):
    args = ["--config", DEBUG, "--model.n_layers=1", "--trainer.max_steps=2",
            "--trainer.val_check_interval=2", f"--data.cache_dir={tmp_path / 'cache'}"]
    result = fit_run(tmp_path, "one", args)
    assert result["step"] == 1 and result["val_bpb"] > 0  # CSVLogger counts steps from 0
    assert json.loads((tmp_path / "one" / "result.json").read_text()) == result
    assert (tmp_path / "one" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert fit_run(tmp_path, "one", ["--no-such-option"]) == result  # cached: not run again


def test_depth_study_writes_tables_and_figures_and_resumes(tmp_path, launch):
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
    other = plot_norm_growth(tmp_path, 1, 1, tmp_path / "norm_growth_L1.png")  # a depth of choice
    assert other == tmp_path / "norm_growth_L1.png" and other.stat().st_size > 10_000
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/result.json")}
    assert len(stamps) == 4
    depth_study(recipe=DEBUG, out=str(tmp_path), depths=[1, 2], seeds=[1], extra=extra)
    assert stamps == {p: p.stat().st_mtime_ns for p in tmp_path.glob("*/result.json")}


def test_isoflop_study_runs_every_recipe_and_seed_and_aggregates(tmp_path, launch):
    from nag_lightning.analysis.isoflop_study import isoflop_study

    recipes = [str(Path(__file__).resolve().parents[1] / "recipes" / "isoflop" / f"{name}.yaml")
               for name in ("nag", "nag_threshold20")]
    extra = ["--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=2",
             "--model.n_layers=1", "--data.max_bytes=300000", f"--data.cache_dir={tmp_path / 'cache'}"]
    rows = isoflop_study(recipes=recipes, out=str(tmp_path), seeds=[1, 2], extra=extra)
    assert [(r["recipe"], r["seeds"]) for r in rows] == [("nag", 2), ("nag_threshold20", 2)]
    assert rows[0]["executed_fraction"] == 1.0  # the threshold router skips nothing in its warm-up
    assert rows[1]["router"].startswith("threshold")
    for row in rows:
        assert row["bpb_min"] <= row["bpb_mean"] <= row["bpb_max"]
        assert row["tokens"] == 4 * 8 * 128  # 4 steps of 8 sequences of 128 bytes
    with (tmp_path / "isoflop.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 4
    assert "nag_threshold20" in (tmp_path / "isoflop.md").read_text()
    assert (tmp_path / "isoflop.png").stat().st_size > 10_000


def test_tradeoff_study_sweeps_both_residuals_onto_one_plot(tmp_path, launch):
    from nag_lightning.analysis.tradeoff_study import tradeoff_study

    extra = ["--trainer.max_steps=3", "--trainer.val_check_interval=3",
             f"--data.cache_dir={tmp_path / 'cache'}"]
    curves = tradeoff_study(depth=1, seeds=[1], depth_out=str(tmp_path / "depth"), recipe=DEBUG,
                            out=str(tmp_path / "tradeoff"), val_batches=2, fit_batches=2, extra=extra)
    assert set(curves) == {("prenorm", 1), ("nag", 1)}
    for rows in curves.values():
        assert {r["method"] for r in rows} == {"threshold", "oracle"}
        assert min(r["mod_rate"] for r in rows) == 0.0 and max(r["mod_rate"] for r in rows) > 0.25
    table = (tmp_path / "tradeoff" / "tradeoff.md").read_text()
    assert "| prenorm | 1 |" in table and "| nag | 1 |" in table
    assert (tmp_path / "tradeoff" / "tradeoff.png").stat().st_size > 10_000


def test_cost_at_rate_interpolates_over_the_full_depth_bpb():
    from nag_lightning.analysis.tradeoff_study import cost_at_rate

    rows = [{"method": "threshold", "mod_rate": rate, "bpb": bpb}
            for rate, bpb in ((0.0, 3.0), (0.1, 3.1), (0.3, 3.5))]
    assert abs(cost_at_rate(rows, "threshold", 0.2) - 0.3) < 1e-12
    assert abs(cost_at_rate(rows, "threshold", 0.1) - 0.1) < 1e-12
    assert cost_at_rate(rows, "threshold", 0.5) != cost_at_rate(rows, "threshold", 0.5)  # NaN: not reached


def test_paired_gains_match_runs_of_the_same_depth_and_seed():
    from nag_lightning.analysis.study import paired_gains

    results = [{"residual": r, "depth": d, "seed": s, "val_bpb": v} for r, d, s, v in (
        ("prenorm", 4, 1, 3.0), ("nag", 4, 1, 2.9), ("prenorm", 4, 2, 3.2), ("nag", 4, 2, 3.3),
        ("nag", 8, 1, 2.5))]  # no prenorm partner at depth 8: left out
    gains = paired_gains(results)
    assert [d for d, _ in gains] == [4, 4]
    assert [round(g, 6) for _, g in gains] == [0.1, -0.1]


def test_a_missing_recipe_is_one_sentence_before_any_run(tmp_path, monkeypatch):
    import pytest

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="No recipe at recipes/study/depth.yaml .* repository root"):
        depth_study(out=str(tmp_path / "out"), depths=[1], seeds=[1])
    assert not (tmp_path / "out").exists()
