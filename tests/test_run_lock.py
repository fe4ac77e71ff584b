"""A run being trained is locked, so two resumes cannot write into it at once; a refused command
leaves no folder behind, and a failed one keeps what it wrote."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import lightning as L
import pytest

from nag_lightning.training.runs import lock_run
from tests.helpers import fit_args, run_cli
from tests.test_bad_input import one_sentence

pytestmark = pytest.mark.usefixtures("one_thread")


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


class LockProbe(L.Callback):
    """Records, at every training step, whether another open of the run's lock is refused."""

    refused: list[bool] = []

    def on_train_batch_start(self, trainer, *args) -> None:
        try:
            lock_run(Path(trainer.log_dir)).close()
            LockProbe.refused.append(False)
        except ValueError:
            LockProbe.refused.append(True)


def _hold_lock(folder: Path, held, done) -> None:
    handle = lock_run(folder)
    held.set()
    done.wait(60)
    handle.close()


def test_a_run_is_locked_while_it_trains_and_a_second_resume_is_refused(
    corpus, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    LockProbe.refused.clear()
    status, err = run_cli(fit_args(corpus, "--trainer.callbacks+=tests.test_run_lock.LockProbe"), capsys)
    assert status == 0, err[-2000:]
    assert LockProbe.refused == [True, True, True]  # every step of the run held its folder's lock
    run = tmp_path / "runs" / "debug" / "version_0"
    lock_run(run).close()  # and let it go when the command ended

    # another process trains the run (it holds the lock): resuming it is refused, nothing changes
    before = snapshot(run)
    context = multiprocessing.get_context("fork")
    held, done = context.Event(), context.Event()
    holder = context.Process(target=_hold_lock, args=(run, held, done))
    holder.start()
    try:
        assert held.wait(60)
        args = fit_args(corpus, "--ckpt_path=last", "--trainer.max_steps=6")
        sentence = one_sentence(*run_cli(args, capsys))
    finally:
        done.set()
        holder.join(60)
    assert f"The run in {Path('runs/debug/version_0')} is being trained by another process" in sentence
    assert snapshot(run) == before  # no steps logged twice, no step6-...-v1.ckpt
    assert [p.name for p in (tmp_path / "runs" / "debug").iterdir()] == ["version_0"]

    # once that process has ended, the same command resumes the run
    status, err = run_cli(fit_args(corpus, "--ckpt_path=last", "--trainer.max_steps=6"), capsys)
    assert status == 0, err[-2000:]
    assert "resuming from" in err


@pytest.mark.parametrize(
    "extra",
    [
        ["--model.arch.router=topk", "--model.arch.router_options={capacity: 0}"],  # the model
        ["--data.source=missing.txt"],  # the data, read once the folder holds the config
        ["--data.source=''"],
        ["--trainer.max_epochs=0"],
        ["--trainer.devices=0"],
        ["--weights_only=false"],  # the checkpoint options
        ["validate", "--trainer.devices=0"],  # the other LightningCLI commands claim folders too
        ["validate", "--ckpt_path=missing.ckpt"],
    ],
    ids=["model", "data_missing", "data_empty", "max_epochs", "devices", "weights_only",
         "validate_devices", "validate_checkpoint"],
)
def test_a_refused_command_leaves_no_folder(extra, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = fit_args(corpus, *extra[1:]) if extra[0] == "validate" else fit_args(corpus, *extra)
    if extra[0] == "validate":
        args = ["validate", *[a for a in args[1:] if not a.startswith("--trainer.max_steps")]]
    one_sentence(*run_cli(args, capsys))
    assert not (tmp_path / "runs").exists()
    # beside an earlier run, only the refused command's own folder goes
    earlier = tmp_path / "runs" / "debug" / "version_0"
    earlier.mkdir(parents=True)
    (earlier / "metrics.csv").write_text("step,val/bpb\n0,3.0\n")
    one_sentence(*run_cli(args, capsys))
    assert [p.name for p in (tmp_path / "runs" / "debug").iterdir()] == ["version_0"]
    assert (earlier / "metrics.csv").read_text() == "step,val/bpb\n0,3.0\n"


class FailAtStep(L.Callback):
    """Raises a ValueError (the kind of error bad input raises) at step 2, after training began."""

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == 2:
            raise ValueError("refused late")


def test_a_command_that_fails_after_training_began_keeps_its_folder(corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    status, err = run_cli(fit_args(corpus, "--trainer.callbacks+=tests.test_run_lock.FailAtStep",
                              "--trainer.val_check_interval=10"), capsys)
    assert status == 1 and "refused late" in err
    run = tmp_path / "runs" / "debug" / "version_0"
    assert (run / "metrics.csv").read_text().count("\n") > 1  # the steps it trained are kept
