"""`nag-lightning study gap`: each residual at its best rate per depth, the gap to the better baseline."""

from __future__ import annotations

import json

import pytest
import yaml

from nag_lightning.analysis.reports.depth_gap import depth_gap


def fake_run(root, residual, depth, lr, seed, accuracy, reached_k2_at=None, task_options=None, router="none",
             residual_options=None):
    """A finished, evaluated `study tasks` run: its config, its evaluation and a validation history."""
    run = root / f"lr{lr}{'_variant' if residual_options else ''}" / f"{residual}-L{depth}-s{seed}"
    (run / "version_0").mkdir(parents=True)
    arch = {"residual": residual, "n_layers": depth, "router": router, "residual_options": residual_options}
    config = {"seed_everything": seed, "trainer": {"max_steps": 3000}, "model": {"lr": lr, "arch": arch},
              "data": {"init_args": {"task": "hops", "task_options": task_options or {"n_nodes": 10}}}}
    (run / "version_0" / "config.yaml").write_text(yaml.safe_dump(config))
    levels = [{"level": -1, "name": "unpredictable", "accuracy": None},
              {"level": 0, "name": "format", "accuracy": 1.0}, {"level": 1, "name": "k1", "accuracy": 0.9},
              *({"level": k, "name": f"k{k}", "accuracy": a} for k, a in zip((2, 3), accuracy))]
    (run / "difficulty.json").write_text(json.dumps({"levels": levels}))
    lines = ["step,val/difficulty/k2/accuracy"]
    for step in (249, 499, 749):
        lines.append(f"{step},{0.9 if reached_k2_at is not None and step + 1 >= reached_k2_at else 0.1}")
    (run / "version_0" / "metrics.csv").write_text("\n".join(lines) + "\n")
    return run


def test_each_residual_is_taken_at_its_best_rate_and_the_gap_is_to_the_better_baseline(tmp_path):
    runs = tmp_path / "runs"
    for seed in (1, 2):
        fake_run(runs, "nag", 8, 3e-3, seed, (0.5, 0.3), reached_k2_at=500)
        fake_run(runs, "prenorm", 8, 3e-3, seed, (0.6, 0.4))
        fake_run(runs, "periln", 8, 3e-3, seed, (0.2, 0.2))
        fake_run(runs, "nag", 16, 3e-3, seed, (0.9, 0.7))
        fake_run(runs, "prenorm", 16, 3e-3, seed, (0.5, 0.5))
    fake_run(runs, "prenorm", 8, 6e-3, 1, (0.7, 0.7))  # better, but on one seed: not chosen
    fake_run(runs, "periln", 16, 1e-3, 1, (0.95, 0.95))  # periln's only rate at 16 blocks
    fake_run(runs, "nag", 16, 1e-3, 1, (1.0, 1.0), router="threshold")  # routed: not read
    gaps = depth_gap([str(runs)], out=str(tmp_path / "out"), reach=0.5)
    assert [g["depth"] for g in gaps] == [8, 16]
    assert gaps[0]["score"] == pytest.approx(0.4 - 0.5)  # nag 0.4 against pre-norm's 3e-3 (two seeds)
    assert gaps[0]["better"] == "prenorm"
    assert gaps[1]["score"] == pytest.approx(0.8 - 0.95) and gaps[1]["better"] == "periln"
    assert gaps[1]["k3"] == pytest.approx(0.7 - 0.95)
    text = (tmp_path / "out" / "gap.md").read_text()
    assert "| 8 | 40.0 (0.003, 2) | 50.0 (0.003, 2) | 20.0 (0.003, 2) | -10.0 |" in text
    assert "| nag | 8 | - | - | 500 (2/2) | - |" in text  # k2 reached 0.5 at step 500, no other level logged
    assert (tmp_path / "out" / "gap.png").is_file()


def test_a_variant_never_joins_the_default_and_shows_only_when_named(tmp_path, capsys):
    runs = tmp_path / "runs"
    fake_run(runs, "nag", 8, 3e-3, 1, (0.2, 0.2))
    fake_run(runs, "prenorm", 8, 3e-3, 1, (0.3, 0.3))
    fake_run(runs, "nag", 8, 3e-3, 1, (0.9, 0.9), residual_options={"theta_max": 0.25})
    gaps = depth_gap([str(runs)], out=str(tmp_path / "out"))
    assert gaps[0]["score"] == pytest.approx(0.2 - 0.3)  # the default's seed alone
    assert "name them in --also" in capsys.readouterr().out
    assert "theta_max" not in (tmp_path / "out" / "gap.md").read_text()
    gaps = depth_gap([str(runs)], out=str(tmp_path / "out"), also=["nag[theta_max=0.25]"])
    assert gaps[0]["score"] == pytest.approx(0.2 - 0.3)  # shown, but no part of the gap
    text = (tmp_path / "out" / "gap.md").read_text()
    assert "| blocks | nag | prenorm | nag[theta_max=0.25] | nag minus the better baseline |" in text
    assert "| 8 | 20.0 (0.003, 1) | 30.0 (0.003, 1) | 90.0 (0.003, 1) | -10.0 |" in text


def test_runs_of_different_tasks_are_refused(tmp_path):
    fake_run(tmp_path, "nag", 8, 3e-3, 1, (0.5, 0.3))
    fake_run(tmp_path, "prenorm", 8, 3e-3, 1, (0.5, 0.3), task_options={"n_nodes": 8})
    with pytest.raises(ValueError, match="different tasks"):
        depth_gap([str(tmp_path)], out=str(tmp_path / "out"))


def test_an_empty_folder_says_what_to_train(tmp_path):
    with pytest.raises(ValueError, match="study tasks"):
        depth_gap([str(tmp_path)], out=str(tmp_path / "out"))
