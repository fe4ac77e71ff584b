"""`nag-lightning study tasks`: every run trained and evaluated by difficulty, cached, and reported."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from nag_lightning.analysis.studies import study
from nag_lightning.analysis.studies.tasks import recipe_setting, steps_to_reach, task_settings, tasks_study
from nag_lightning.tasks.evaluation import evaluate_checkpoint, task_sequences
from tests.helpers import run_command
from tests.test_study import InProcess

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "recipes" / "tasks" / "debug.yaml")


@pytest.fixture
def in_process(monkeypatch):
    monkeypatch.setattr(study, "subprocess", InProcess)


def test_study_tasks_trains_evaluates_and_reports_every_run(tmp_path, monkeypatch, in_process, one_thread):
    monkeypatch.chdir(tmp_path)
    options = dict(recipe=DEBUG, out="study", depths=[1, 2], seeds=[3], residuals=["prenorm", "nag"],
                   lrs={"nag": 5e-3}, extra=["--trainer.max_steps=2", "--trainer.val_check_interval=2"],
                   eval_sequences=8)
    rows = tasks_study(**options)
    out = tmp_path / "study"
    runs = {(r["residual"], r["depth"]) for r in rows}
    assert runs == {("prenorm", 1), ("prenorm", 2), ("nag", 1), ("nag", 2)}
    config = (out / "nag-L2-s3" / "version_0" / "config.yaml").read_text()
    assert "lr: 0.005" in config and "n_layers: 2" in config and "seed_everything: 3" in config
    assert "lr: 0.005" not in (out / "prenorm-L2-s3" / "version_0" / "config.yaml").read_text()
    with (out / "tasks.csv").open() as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == len(rows) == 4 * 5  # levels: unpredictable, format, k1..k3
    levels = {r["name"] for r in table}
    assert levels == {"unpredictable", "format", "k1", "k2", "k3"}
    k3 = next(r for r in table if r["residual"] == "nag" and r["depth"] == "2" and r["name"] == "k3")
    assert int(k3["count"]) > 0 and 0 <= float(k3["accuracy"]) <= 1 and float(k3["executed"]) == 4
    assert float(k3["angle"]) > 0 and k3["planned_angle"] != "nan"  # NAG plans its angle; prenorm does not
    prenorm = next(r for r in table if r["residual"] == "prenorm" and r["name"] == "k1")
    assert prenorm["planned_angle"] == "nan" and prenorm["spearman_planned"] == "nan"
    assert -1 <= float(k3["spearman_angle"]) <= 1
    assert -1 <= float(k3["spearman_angle_predictable"]) <= 1  # over format tokens and answers too
    markdown = (out / "tasks.md").read_text()
    assert "acc format" in markdown and "acc k3" in markdown and "rho angle" in markdown
    assert "rho angle, format and answers" in markdown
    assert markdown.count("\n| nag |") == 2 and markdown.count("\n| prenorm |") == 2
    for figure in ("tasks.png", "tasks_compute.png"):
        assert (out / figure).stat().st_size > 10_000
    with (out / "tasks_history.csv").open() as handle:  # accuracy per level at every validation
        history = list(csv.DictReader(handle))
    nag_k1 = [r for r in history if r["residual"] == "nag" and r["depth"] == "2" and r["name"] == "k1"]
    assert [int(r["step"]) for r in nag_k1] == [2] and 0 <= float(nag_k1[0]["accuracy"]) <= 1
    steps = (out / "tasks_steps.md").read_text()
    assert "| residual | router | blocks | format | k1 | k2 | k3 |" in steps and "reached 0.9" in steps
    with pytest.raises(ValueError, match="more than the checkpoint's model.arch.seq_len = 48"):
        evaluate_checkpoint(str(out / "nag-L1-s3" / "version_0" / "checkpoints" / "last.ckpt"),
                            task_sequences("hops", {}, 2, 65, seed=0))
    # evaluated on fresh sequences once: a second study reads every result from the cache
    evaluation = json.loads((out / "nag-L1-s3" / "difficulty.json").read_text())
    next(r for r in evaluation["levels"] if r["name"] == "k2")["accuracy"] = 0.123456
    (out / "nag-L1-s3" / "difficulty.json").write_text(json.dumps(evaluation))
    # a result cached before the correlation over format and answers is scored again, not retrained
    older = json.loads((out / "nag-L2-s3" / "difficulty.json").read_text())
    del older["spearman_angle_predictable"]
    (out / "nag-L2-s3" / "difficulty.json").write_text(json.dumps(older))
    monkeypatch.setattr(study, "subprocess", None)  # nothing is trained again
    again = tasks_study(**options)
    assert any(r.get("accuracy") == 0.123456 for r in again)
    rescored = [r for r in again if r["residual"] == "nag" and r["depth"] == 2]
    assert all(-1 <= r["spearman_angle_predictable"] <= 1 for r in rescored)


def test_each_router_setting_is_its_own_run_and_its_skips_are_counted(tmp_path, monkeypatch, in_process,
                                                                       one_thread):
    """With --iso_flop every run spends the full-depth model's FLOPs of the recipe's steps: the
    unrouted run stops at those steps, the routed one, cheaper per step, trains longer."""
    monkeypatch.chdir(tmp_path)
    topk = ["--model.arch.router=topk", "--model.arch.router_options={capacity: 0.5}"]
    options = dict(recipe=DEBUG, out="study", depths=[2], seeds=[1], residuals=["nag"],
                   routers={"none": [], "topk50": topk}, eval_sequences=4, iso_flop=True,
                   extra=["--trainer.max_steps=2", "--trainer.val_check_interval=1"])
    rows = tasks_study(**options)
    assert {r["router"] for r in rows} == {"none", "topk50"}
    config = tmp_path / "study" / "nag-L2-s1-topk50" / "version_0" / "config.yaml"
    assert "router: topk" in config.read_text()
    assert "reference_tokens: 384" in config.read_text() and "schedule: wsd" in config.read_text()
    steps = {r["router"]: r["steps"] for r in rows}
    assert steps["none"] == 2 and steps["topk50"] > 2, steps
    skips = {r["router"]: sum(x["skip_rate"] * x["count"] for x in rows if x["router"] == r["router"])
             for r in rows}
    assert skips["none"] == 0 and skips["topk50"] > 0
    # a routed run is also scored with every token run through every sublayer; an unrouted one not
    assert all((r["router"] == "topk50") == ("accuracy_every_token" in r) for r in rows)
    assert all(0 <= r["accuracy_every_token"] <= 1 for r in rows if r.get("accuracy_every_token") is not None)
    assert "| nag | topk50 | 2 |" in (tmp_path / "study" / "tasks.md").read_text()
    # skip rates per sublayer kind; a routed result cached without them is scored again
    cached_path = tmp_path / "study" / "nag-L2-s1-topk50" / "difficulty.json"
    cached = json.loads(cached_path.read_text())
    assert all(0 <= row["skip_rate_attn"] <= 1 and 0 <= row["skip_rate_mlp"] <= 1 for row in cached["levels"])
    for row in cached["levels"]:
        del row["skip_rate_attn"], row["skip_rate_mlp"]
    cached_path.write_text(json.dumps(cached))
    monkeypatch.setattr(study, "subprocess", None)  # nothing is trained again
    again = tasks_study(**options)
    assert all("skip_rate_attn" in r for r in again if r["router"] == "topk50")


def test_steps_to_reach_and_recipe_settings(tmp_path):
    history = [{"step": 2, "name": "k1", "accuracy": 0.5}, {"step": 2, "name": "k2", "accuracy": 0.1},
               {"step": 4, "name": "k1", "accuracy": 0.95}, {"step": 4, "name": "k2", "accuracy": 0.2},
               {"step": 6, "name": "k1", "accuracy": 0.85}]
    assert steps_to_reach(history, 0.9) == {"k1": 4, "k2": None}
    assert recipe_setting(DEBUG, [], "data.batch_size") == 4
    assert recipe_setting(DEBUG, ["--trainer.max_steps=9"], "trainer.max_steps") == 9
    assert recipe_setting(DEBUG, [], "model.arch.seq_len") == 48


def test_a_recipe_on_text_is_refused_with_one_sentence(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("model: {arch: {seq_len: 32}}\ndata: {class_path: nag_lightning.ByteDataModule}\n")
    with pytest.raises(ValueError, match="is not a run on a generated task"):
        task_settings(config)


def test_bad_options_get_one_sentence(tmp_path, capsys, monkeypatch, no_plugins):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_command(["study", "tasks", "--recipe", DEBUG, "--residuals", "[prenorm, nope]"],
                                 capsys)
    assert status == 1 and "Unknown residual strategy 'nope'" in err
    status, _, err = run_command(["study", "tasks", "--recipe", DEBUG, "--lrs", "{periln: 0.01}"], capsys)
    assert status == 1 and "--lrs gives a learning rate for ['periln']" in err
    status, _, err = run_command(["study", "tasks", "--recipe", DEBUG, "--lrs", "{nag: 0}"], capsys)
    assert status == 1 and "must be positive" in err
    assert not (tmp_path / "runs").exists()
