"""`nag-lightning study depth` runs every point, resumes without rerunning, and writes its outputs."""

from __future__ import annotations

import contextlib
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from nag_lightning.analysis.studies import depth, study
from nag_lightning.analysis.studies.depth import depth_study, plot_norm_growth
from nag_lightning.analysis.studies.study import fit_run

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
    args = ["--config", DEBUG, "--model.arch.n_layers=1", "--trainer.max_steps=2",
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
    from nag_lightning.analysis.studies.isoflop import isoflop_study

    recipes = [str(Path(__file__).resolve().parents[1] / "recipes" / "isoflop" / f"{name}.yaml")
               for name in ("nag", "nag_threshold20")]
    extra = ["--trainer.max_steps=4", "--trainer.val_check_interval=2", "--trainer.limit_val_batches=2",
             "--model.arch.n_layers=1", "--data.max_bytes=300000", f"--data.cache_dir={tmp_path / 'cache'}"]
    rows = isoflop_study(recipes=recipes, out=str(tmp_path), seeds=[1, 2], extra=extra)
    assert [(r["recipe"], r["seeds"]) for r in rows] == [("nag", 2), ("nag_threshold20", 2)]
    assert rows[0]["executed_fraction"] == 1.0  # the threshold router skips nothing in its warm-up
    assert rows[1]["router"].startswith("threshold")
    for row in rows:
        assert row["bpb_min"] <= row["bpb_mean"] <= row["bpb_max"]
        assert row["tokens"] == 4 * 8 * 128  # 4 steps of 8 sequences of 128 bytes
        assert row["train_seconds"] > 0  # FlopAccounting logged the training time beside the FLOPs
    with (tmp_path / "isoflop.csv").open() as handle:
        runs = list(csv.DictReader(handle))
    assert len(runs) == 4 and all(float(r["train_seconds"]) > 0 for r in runs)
    assert "nag_threshold20" in (tmp_path / "isoflop.md").read_text()
    assert "training seconds (mean)" in (tmp_path / "isoflop.md").read_text()
    for figure in ("isoflop.png", "isoflop_time.png"):
        assert (tmp_path / figure).stat().st_size > 10_000


def test_tradeoff_study_sweeps_both_residuals_onto_one_plot(tmp_path, launch):
    from nag_lightning.analysis.studies.tradeoff import tradeoff_study

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
    from nag_lightning.analysis.studies.tradeoff import cost_at_rate

    rows = [{"method": "threshold", "mod_rate": rate, "bpb": bpb}
            for rate, bpb in ((0.0, 3.0), (0.1, 3.1), (0.3, 3.5))]
    assert abs(cost_at_rate(rows, "threshold", 0.2) - 0.3) < 1e-12
    assert abs(cost_at_rate(rows, "threshold", 0.1) - 0.1) < 1e-12
    assert cost_at_rate(rows, "threshold", 0.5) != cost_at_rate(rows, "threshold", 0.5)  # NaN: not reached


def test_paired_gains_match_runs_of_the_same_depth_and_seed():
    from nag_lightning.analysis.studies.depth import paired_gains

    results = [{"residual": r, "depth": d, "seed": s, "val_bpb": v} for r, d, s, v in (
        ("prenorm", 4, 1, 3.0), ("nag", 4, 1, 2.9), ("prenorm", 4, 2, 3.2), ("nag", 4, 2, 3.3),
        ("nag", 8, 1, 2.5))]  # no prenorm partner at depth 8: left out
    gains = paired_gains(results)
    assert [d for d, _ in gains] == [4, 4]
    assert [round(g, 6) for _, g in gains] == [0.1, -0.1]


def test_a_missing_recipe_is_one_sentence_before_any_run(tmp_path, monkeypatch):
    import pytest

    monkeypatch.chdir(tmp_path)
    for recipe in ("elsewhere/depth.yaml", "recipes/study/missing.yaml"):
        with pytest.raises(FileNotFoundError, match=f"No recipe at {recipe} .* package's own recipes"):
            depth_study(recipe=recipe, out=str(tmp_path / "out"), depths=[1], seeds=[1])
    assert not (tmp_path / "out").exists()


def test_studies_find_their_default_recipes_from_any_folder(tmp_path, monkeypatch):
    """An installed package run outside a checkout: every study's default recipe is the package's
    own, and a study trains on it."""
    import inspect

    from nag_lightning.analysis.studies import isoflop as isoflop_study
    from nag_lightning.analysis.studies import tasks as tasks_study
    from nag_lightning.analysis.studies import tradeoff as tradeoff_study

    root = Path(__file__).resolve().parents[1] / "recipes"
    monkeypatch.chdir(tmp_path)
    defaults = [inspect.signature(f).parameters["recipe"].default
                for f in (depth_study, tasks_study.tasks_study, tradeoff_study.tradeoff_study)]
    defaults += inspect.signature(isoflop_study.isoflop_study).parameters["recipes"].default
    for default in defaults:
        found = Path(study.find_recipe(default))
        assert found.is_absolute() and found.read_bytes() == (root.parent / default).read_bytes()
    trained = []
    monkeypatch.setattr(study, "fit_run", lambda out, name, args: trained.append(args) or
                        {"val_bpb": 3.0, "step": 3, "wall_s": 0.0})
    depth_study(out=str(tmp_path / "out"), depths=[1], seeds=[1], residuals=["nag"])
    config = trained[0][trained[0].index("--config") + 1]
    assert Path(config).read_bytes() == (root / "study" / "depth.yaml").read_bytes()


def test_every_recipe_ships_with_the_package():
    """The wheel maps recipes/ into the package by the globs of pyproject.toml: a recipe they miss
    would be missing from an installed package."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"]["nag_lightning.recipes"] == "recipes"
    assert "nag_lightning.recipes" in setuptools["packages"]
    shipped = {path for glob in setuptools["package-data"]["nag_lightning.recipes"]
               for path in (root / "recipes").glob(glob)}
    assert shipped == set((root / "recipes").rglob("*.yaml")) and shipped


def test_the_gain_is_reported_for_the_focus_strategy(tmp_path):
    results = [{"residual": r, "depth": 4, "seed": 1, "val_bpb": v, "angle_q10_q90": None}
               for r, v in (("prenorm", 3.0), ("nag", 2.9), ("lns", 2.8))]
    row = depth.summarise(results, tmp_path, focus="lns")[0]
    assert row["best_other"] == "nag" and abs(row["lns_gain"] - 0.1) < 1e-9
    assert abs(row["lns_gain_prenorm"] - 0.2) < 1e-9 and "nag_gain" not in row
    assert "lns gain over it (bpb)" in (tmp_path / "depth.md").read_text()


def test_a_sweep_picks_on_one_half_of_validation_and_reports_the_other(tmp_path, launch):
    """Per (strategy, depth) the learning rate with the best selection half wins; the table shows
    its report half and the run's angle spread from its diagnostics; per-strategy options apply."""
    import json

    extra = ["--trainer.max_steps=3", "--trainer.val_check_interval=3",
             f"--data.cache_dir={tmp_path / 'cache'}"]
    rows = depth_study(recipe=DEBUG, out=str(tmp_path), depths=[1], seeds=[1], residuals=["periln"],
                       extra=extra, residual_extra={"periln": ["--model.warmup_steps=1"]},
                       lrs=[1e-3, 1e-2], split_batches=4)
    runs = {p.parent.name: json.loads(p.read_text()) for p in tmp_path.glob("*/result.json")}
    assert sorted(runs) == ["periln-L1-s1-lr0.001", "periln-L1-s1-lr0.01"]
    picked = min((runs["periln-L1-s1-lr0.001"], 1e-3), (runs["periln-L1-s1-lr0.01"], 1e-2),
                 key=lambda pair: pair[0]["select_bpb"])
    assert rows[0]["periln_lr"] == picked[1]
    assert rows[0]["periln_mean"] == picked[0]["report_bpb"] != picked[0]["select_bpb"]
    assert 0 < rows[0]["periln_angle_q10_q90"] <= 1
    config = (tmp_path / "periln-L1-s1-lr0.01" / "version_0" / "hparams.yaml").read_text()
    assert "warmup_steps: 1" in config and "lr: 0.01" in config
    table = (tmp_path / "depth.md").read_text()
    assert f"| 1 | {picked[0]['report_bpb']:.4f}" in table and "periln angle q10/q90" in table
    assert (tmp_path / "norm_growth.png").stat().st_size > 10_000


def test_the_nag_gain_is_stated_against_the_best_other_strategy(tmp_path, monkeypatch):
    from nag_lightning.analysis.studies import study

    bpb = {"prenorm": 3.0, "nag": 2.8, "lns": 2.7, "periln": 2.9, "ngpt": 3.1}

    def fake_fit_run(out, name, args):
        residual = name.split("-L")[0]
        seed = int(name.split("-s")[1][0])
        return {"val_bpb": bpb[residual] + 0.01 * seed, "step": 3, "wall_s": 0.0}

    monkeypatch.setattr(study, "fit_run", fake_fit_run)
    rows = depth_study(recipe=DEBUG, out=str(tmp_path), depths=[4, 8], seeds=[1, 2], residuals=list(bpb))
    for row in rows:
        assert row["best_other"] == "lns"
        assert abs(row["nag_gain"] - (-0.1)) < 1e-9 and abs(row["nag_gain_prenorm"] - 0.2) < 1e-9
        assert row["ngpt_angle_q10_q90"] is None  # no diagnostics without a real run
    gains = depth.paired_gains(depth.choose([
        {"residual": r, "depth": 4, "seed": s, "val_bpb": v + 0.01 * s}
        for r, v in bpb.items() for s in (1, 2)]))
    assert [round(g, 6) for _, g in gains] == [-0.1, -0.1]
    header = (tmp_path / "depth.md").read_text().splitlines()[0]
    for residual in bpb:
        assert f"{residual} bpb" in header and f"{residual} angle q10/q90" in header
    assert (tmp_path / "depth.png").stat().st_size > 10_000


def test_angle_spread_is_the_median_over_sublayers_of_q10_over_q90(tmp_path):
    import json

    from nag_lightning.analysis.studies.study import angle_spread

    path = tmp_path / "depth_diagnostics.json"
    path.write_text(json.dumps([{"q0.1": [9.0, 9.0, 9.0], "q0.9": [9.0, 9.0, 9.0]},  # not the last
                                {"q0.1": [0.1, 0.2, 0.6], "q0.9": [1.0, 0.4, 0.8]}]))
    assert abs(angle_spread(path) - 0.5) < 1e-12
    assert angle_spread(tmp_path / "missing.json") is None


def test_bad_study_options_are_one_sentence_before_any_run(tmp_path):
    import pytest

    out = tmp_path / "out"
    with pytest.raises(ValueError, match="Unknown residual strategy 'postnorm'; registered: .*nag"):
        depth_study(recipe=DEBUG, out=str(out), residuals=["prenorm", "postnorm"])
    with pytest.raises(ValueError, match="--residual_extra gives options for \\['lns'\\]"):
        depth_study(recipe=DEBUG, out=str(out), residuals=["nag"], residual_extra={"lns": ["--model.lr=1"]})
    with pytest.raises(ValueError, match="must be positive"):
        depth_study(recipe=DEBUG, out=str(out), lrs=[0.0])
    assert not out.exists()


def test_each_strategy_may_sweep_learning_rates_of_its_own(tmp_path, monkeypatch):
    """`--lrs` as a mapping: each strategy trains only its own grid, and reports its best on it."""
    import pytest

    from nag_lightning.analysis.studies import study

    trained = []

    def fake_fit_run(out, name, args):
        trained.append(name)
        lr = float(name.split("-lr")[1])
        bpb = {"prenorm": 3.0, "nag": 2.9}[name.split("-L")[0]] + abs(lr - 6e-3)
        return {"val_bpb": bpb, "step": 3, "wall_s": 0.0, "select_bpb": bpb, "report_bpb": bpb + 0.5}

    monkeypatch.setattr(study, "fit_run", fake_fit_run)
    rows = depth_study(recipe=DEBUG, out=str(tmp_path), depths=[4], seeds=[1], residuals=["prenorm", "nag"],
                       lrs={"prenorm": [3e-3, 6e-3], "nag": [1.2e-2]})
    assert sorted(trained) == ["nag-L4-s1-lr0.012", "prenorm-L4-s1-lr0.003", "prenorm-L4-s1-lr0.006"]
    assert rows[0]["prenorm_lr"] == 6e-3 and rows[0]["nag_lr"] == 1.2e-2
    assert rows[0]["prenorm_mean"] == 3.5
    with pytest.raises(ValueError, match="--lrs gives options for \\['lns'\\]"):
        depth_study(recipe=DEBUG, out=str(tmp_path / "bad"), residuals=["nag"], lrs={"lns": [1e-3]})


def test_tradeoff_study_finds_the_runs_of_a_learning_rate_sweep(tmp_path, monkeypatch):
    """With `lrs`, each residual's run is the depth study's run at that learning rate."""
    from nag_lightning.analysis.studies import tradeoff

    trained, swept = [], []
    monkeypatch.setattr(tradeoff, "run_one", lambda *args: trained.append((args[2], args[-1])))
    rows = [{"method": m, "mod_rate": rate, "bpb": 3.0 + rate, "setting": "", "executed_flops": 1 - rate}
            for m in ("threshold", "oracle") for rate in (0.0, 0.1, 0.2, 0.3)]
    monkeypatch.setattr(tradeoff, "sweep_run", lambda ckpt, *args: swept.append(ckpt) or rows)
    monkeypatch.setattr(tradeoff, "plot", lambda *args: None)
    (tmp_path / "tradeoff").mkdir()
    tradeoff.tradeoff_study(depth=8, seeds=[1], residuals=["prenorm", "nag"], depth_out=str(tmp_path),
                            out=str(tmp_path / "tradeoff"), lrs={"nag": 1.2e-2})
    assert trained == [("prenorm", None), ("nag", 1.2e-2)]
    assert [p.parts[-4] for p in swept] == ["prenorm-L8-s1", "nag-L8-s1-lr0.012"]


def test_tradeoff_study_passes_each_residuals_router_options_to_its_sweeps(tmp_path, monkeypatch):
    from nag_lightning.analysis.studies import tradeoff

    options = []
    monkeypatch.setattr(tradeoff, "run_one", lambda *args: None)
    rows = [{"method": m, "mod_rate": rate, "bpb": 3.0 + rate, "setting": "", "executed_flops": 1 - rate}
            for m in ("threshold", "oracle") for rate in (0.0, 0.1, 0.2, 0.3)]
    monkeypatch.setattr(tradeoff, "sweep_run", lambda *args: options.append(args[-1]) or rows)
    monkeypatch.setattr(tradeoff, "plot", lambda *args: None)
    (tmp_path / "tradeoff").mkdir()
    tradeoff.tradeoff_study(depth=8, seeds=[1], residuals=["prenorm", "nag"], depth_out=str(tmp_path),
                            out=str(tmp_path / "tradeoff"), router_options={"nag": {"predictor": "angle"}})
    assert options == [None, {"predictor": "angle"}]
