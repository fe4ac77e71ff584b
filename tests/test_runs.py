"""Run folders: one version folder per run for every logger, claimed atomically, and
`--ckpt_path last` continuing a run in its own folder, step for step."""

from __future__ import annotations

import csv
import multiprocessing
from pathlib import Path

import lightning as L
import pytest
import torch

from nag_lightning.analysis.reports.compare import compare
from nag_lightning.cli import main
from nag_lightning.training.runs import claim_version, latest_run
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "recipes" / "debug.yaml")
TWO_LOGGERS = """
trainer:
  logger:
    - class_path: lightning.pytorch.loggers.CSVLogger
      init_args: {save_dir: runs, name: debug}
    - class_path: lightning.pytorch.loggers.TensorBoardLogger
      init_args: {save_dir: runs, name: debug}
"""


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("data_cache"))


def two_loggers(tmp_path: Path) -> str:
    path = tmp_path / "two_loggers.yaml"
    path.write_text(TWO_LOGGERS)
    return str(path)


def fit_args(tmp_path: Path, cache_dir: str, *extra: str) -> list[str]:
    # 3000 bytes make an epoch of 22 steps, so 30 steps cross an epoch boundary.
    return [
        "fit", "--config", DEBUG, "--config", two_loggers(tmp_path), f"--data.cache_dir={cache_dir}",
        "--data.max_bytes=3000", "--trainer.max_steps=30", "--trainer.val_check_interval=10",
        "--trainer.enable_progress_bar=false",
        *extra,  # the debug recipe accounts FLOPs itself, which compare reads
    ]


def losses(metrics_csv: Path) -> dict[int, str]:
    with open(metrics_csv, newline="") as file:
        rows = list(csv.DictReader(file))
    train = [(int(r["step"]), r["train/loss"]) for r in rows if r["train/loss"]]
    assert len(train) == len(dict(train)), "a step is logged twice"
    return dict(train)


class Crash(L.Callback):
    """Fails inside step `step` (after its batch was read), as a kill or a node failure would."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("node failure")


def test_one_run_writes_one_folder_and_ckpt_path_last_continues_it_exactly(
    tmp_path, cache_dir, capsys, monkeypatch
):
    straight, requeued = tmp_path / "straight", tmp_path / "requeued"
    for folder in (straight, requeued):
        folder.mkdir()
    monkeypatch.chdir(straight)
    assert run_cli(fit_args(tmp_path, cache_dir), capsys)[0] == 0
    expected = losses(straight / "runs" / "debug" / "version_0" / "metrics.csv")
    assert sorted(expected) == list(range(30))

    monkeypatch.chdir(requeued)
    command = fit_args(tmp_path, cache_dir, "--ckpt_path=last")
    crash = ["--trainer.callbacks+=tests.test_runs.Crash", "--trainer.callbacks.step=25"]
    with pytest.raises(RuntimeError, match="node failure"):  # first submission: nothing to resume
        main(command + crash)
    assert "no last.ckpt of an earlier run in runs/debug; starting a new run." in capsys.readouterr().err
    run = requeued / "runs" / "debug" / "version_0"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 25

    status, err = run_cli(command, capsys)  # the requeued job: the same command
    assert status == 0, err[-2000:]
    assert f"resuming from {Path('runs/debug/version_0/checkpoints/last.ckpt')}" in err
    # one run, one folder: both loggers, checkpoints, config and diagnostics in version_0
    assert [p.name for p in (requeued / "runs" / "debug").iterdir()] == ["version_0"]
    assert {"metrics.csv", "config.yaml", "hparams.yaml", "checkpoints", "depth_diagnostics.png"} <= {
        p.name for p in run.iterdir()
    }
    assert list(run.glob("events.out.tfevents.*"))
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 30
    # step for step the same losses as the uninterrupted run, across the epoch boundary at 22
    assert losses(run / "metrics.csv") == expected

    # `compare` finds the run's metrics, and counts every step once: the same tokens, FLOPs and
    # final bits per byte as the uninterrupted run
    resumed, uninterrupted = compare([run, straight / "runs" / "debug" / "version_0"], tmp_path / "cmp")
    # wall-clock seconds differ between any two runs; the resumed run counts both of its parts
    assert resumed.row()["train_seconds"] > 0 and uninterrupted.row()["train_seconds"] > 0
    same = {"run": "", "train_seconds": 0}
    assert {**resumed.row(), **same} == {**uninterrupted.row(), **same}
    assert resumed.steps == 30


def _claim_many(roots: list[Path], count: int, queue) -> None:
    queue.put([claim_version(roots) for _ in range(count)])


def test_concurrent_runs_claim_distinct_version_folders(tmp_path):
    roots = [tmp_path / "csv" / "run", tmp_path / "tb" / "run"]
    (roots[0] / "version_2").mkdir(parents=True)  # an earlier run
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    workers = [context.Process(target=_claim_many, args=(roots, 15, queue)) for _ in range(4)]
    for worker in workers:
        worker.start()
    claimed = [n for _ in workers for n in queue.get(timeout=60)]
    for worker in workers:
        worker.join(timeout=60)
    assert sorted(claimed) == list(range(3, 63))  # every version exactly once, after the existing one
    for root in roots:
        assert {p.name for p in root.iterdir()} >= {f"version_{n}" for n in claimed}


def test_latest_run_is_the_newest_version_with_a_last_checkpoint(tmp_path):
    assert latest_run(tmp_path / "none") is None
    for n in (0, 1, 3):
        (tmp_path / f"version_{n}" / "checkpoints").mkdir(parents=True)
    for n in (0, 1):
        (tmp_path / f"version_{n}" / "checkpoints" / "last.ckpt").write_bytes(b"")
    (tmp_path / "version_10").mkdir()  # started, killed before its first checkpoint
    assert latest_run(tmp_path) == (1, tmp_path / "version_1" / "checkpoints" / "last.ckpt")
