"""`nag-lightning study tradeoff_tasks`: post-training skipping on the full-depth runs of a task
study, by difficulty level; and the sweep's data and routers for a task checkpoint."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from nag_lightning.analysis.studies import study, tradeoff_tasks
from nag_lightning.analysis.studies.tasks import evaluate_run, tasks_study
from nag_lightning.analysis.studies.tradeoff_tasks import tradeoff_tasks_study
from tests.helpers import run_command
from tests.test_study import InProcess

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "tasks" / "debug.yaml")
EVAL = 8  # sequences: every setting of a sweep is evaluated on these


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_thread) -> Path:
    """A task study's folder with nag-L2-s1-full, trained without a router and evaluated by
    `study tasks` on EVAL sequences, and nag-L2-s1-topk50, trained with a router."""
    out = tmp_path_factory.mktemp("tasks")
    topk = ["--model.arch.router=topk", "--model.arch.router_options={capacity: 0.5}"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(study, "subprocess", InProcess)
        tasks_study(recipe=DEBUG, out=str(out), depths=[2], seeds=[1], residuals=["nag"],
                    routers={"full": [], "topk50": topk}, eval_sequences=EVAL,
                    extra=["--trainer.max_steps=4", "--trainer.val_check_interval=4"])
    return out


def sweep(runs: Path, out: Path, **options) -> dict:
    settings = dict(runs_dir=str(runs), run_label="full", depth=2, seeds=[1], residuals=["nag"],
                    eval_sequences=EVAL, fit_batches=4, out=str(out))
    return tradeoff_tasks_study(**{**settings, **options})


def settings_of(rows: list[dict]) -> dict:
    """(method, tau) -> {level name: row}, in the order swept."""
    found: dict = {}
    for row in rows:
        found.setdefault((row["method"], row["tau"]), {})[row["name"]] = row
    return found


@pytest.mark.parametrize("router_options", [{}, {"nag": {"predictor": "angle"}}], ids=["probe", "angle"])
def test_every_setting_is_scored_by_level_and_tau_zero_is_the_full_depth_model(runs, tmp_path,
                                                                                router_options):
    rows = sweep(runs, tmp_path, router_options=router_options)[("nag", 1)]
    settings = settings_of(rows)
    full = settings.pop(("full", None))
    # the run's own full-depth accuracy per level, as `study tasks` measured it on the same sequences
    measured = evaluate_run(runs / "nag-L2-s1-full", EVAL, 1000, False)  # cached by the fixture's study
    trained = {r["name"]: r["accuracy"] for r in measured["levels"]}
    assert {name: r["accuracy"] for name, r in full.items()} == trained
    taus = sorted(settings)
    assert taus[0] == ("threshold", 0.0) and len(taus) >= 5
    zero = settings[taus[0]]
    assert {name: r["accuracy"] for name, r in zero.items()} == trained  # exactly: nothing is skipped
    assert all(r["skip_rate"] == 0 and r["mod_rate"] == 0 for r in zero.values())
    rates = [next(iter(settings[tau].values()))["mod_rate"] for tau in taus]
    assert rates == sorted(rates) and rates[-1] > 0.3, rates  # skipping rises with tau
    # real skipping from the first setting on: the attached routers evaluate in eval mode, where a
    # router left in training mode would run every token for a warm-up of one forward per fit batch
    assert all(rate > 0 for rate in rates[1:]), rates
    fractions = [next(iter(settings[tau].values()))["executed_fraction"] for tau in taus]
    assert fractions == sorted(fractions, reverse=True) and fractions[-1] < 0.8
    with (tmp_path / "tradeoff_tasks.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(rows) == (len(taus) + 1) * 5  # levels: unpredictable, format, k1..k3
    assert {r["run"] for r in table} == {"nag-L2-s1-full"} and {r["name"] for r in table} == set(trained)
    markdown = (tmp_path / "tradeoff_tasks.md").read_text()
    head = "| residual | seeds | MoD rate | FLOP fraction | format | k1 | k2 | k3 | unpredictable |"
    assert head in markdown
    assert "| nag | 1/1 | full depth | 1.000 |" in markdown and "| nag | 1/1 | 25% |" in markdown
    assert "linearly interpolated" in markdown
    assert (tmp_path / "tradeoff_tasks.png").stat().st_size > 10_000


def test_reading_a_curve_at_a_rate_interpolates_between_the_settings_around_it():
    def level(method, tau, rate, name, accuracy, skip):
        return {"method": method, "tau": tau, "mod_rate": rate, "executed_fraction": 1 - rate,
                "name": name, "accuracy": accuracy, "skip_rate": skip}

    rows = [level("full", None, 0.0, "k1", 0.9, 0.0), level("threshold", 0.0, 0.0, "k1", 0.9, 0.0),
            level("threshold", 0.1, 0.2, "k1", 0.7, 0.1), level("threshold", 0.2, 0.4, "k1", 0.3, 0.5)]
    read = tradeoff_tasks.at_rate(rows, 0.25)
    assert read["k1"] == pytest.approx((0.6, 0.2)) and read["executed_fraction"] == pytest.approx(0.75)
    assert tradeoff_tasks.at_rate(rows, None)["k1"] == (0.9, 0.0)
    assert tradeoff_tasks.at_rate(rows, 0.5) is None  # the sweep did not reach it


def test_a_run_is_swept_once_and_read_back(runs, tmp_path, monkeypatch):
    first = sweep(runs, tmp_path)
    monkeypatch.setattr(tradeoff_tasks, "sweep_run", None)  # nothing is evaluated again
    assert sweep(runs, tmp_path) == first
    called = []  # other options: swept again
    monkeypatch.setattr(tradeoff_tasks, "sweep_run", lambda run, **kw: called.append(kw) or first[("nag", 1)])
    sweep(runs, tmp_path, eval_sequences=EVAL + 1)
    assert len(called) == 1 and called[0]["eval_sequences"] == EVAL + 1
    cached = json.loads((tmp_path / "nag-L2-s1-full" / "tradeoff_tasks.json").read_text())
    assert cached["settings"]["eval_sequences"] == EVAL + 1


def test_a_routed_run_and_a_missing_one_get_one_sentence(runs, tmp_path, capsys, no_plugins):
    with pytest.raises(ValueError, match="nag-L2-s1-topk50 was trained with the router 'topk'"):
        sweep(runs, tmp_path, run_label="topk50")
    status, _, err = run_command(["study", "tradeoff_tasks", "--runs_dir", str(runs), "--run_label", "full",
                                  "--depth", "2", "--seeds", "[1, 2]", "--residuals", "[nag]",
                                  "--out", str(tmp_path)], capsys)
    assert status == 1 and "No finished run nag-L2-s2-full in" in err
    assert f"nag-lightning study tasks --out {runs} --residuals '[nag]' --depths '[2]' --seeds '[2]' " \
           "--routers '{full: []}'" in err
    assert not (tmp_path / "nag-L2-s1-full").exists()  # every run is looked for before any is swept


def test_a_sweep_of_a_task_checkpoint_runs_on_its_task(runs):
    from nag_lightning.analysis.evaluation.checkpoint import checkpoint_data, first_batches
    from nag_lightning.analysis.sweeps.sweep import sweep as sweep_checkpoint
    from nag_lightning.checkpoints.loading import load_model
    from nag_lightning.tasks.datamodule import TaskDataModule

    ckpt = runs / "nag-L2-s1-full" / "version_0" / "checkpoints" / "last.ckpt"
    loaded = load_model(ckpt)
    assert loaded.task is not None and loaded.task.name == "hops" and not loaded.task.from_file
    data = checkpoint_data(loaded)
    assert isinstance(data, TaskDataModule) and data.seq_len == 48
    assert first_batches(data.val_dataloader(), 1)[0].equal(data.val_set.tokens[:4])
    with pytest.raises(ValueError, match="drop --source, which name text"):
        sweep_checkpoint(str(ckpt), source="elsewhere.txt")
