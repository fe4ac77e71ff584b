"""RunCheckpoint: last.ckpt is always the newest finite state, the end of training is always saved,
and a run stopped by an exception resumes exactly where it stopped."""

from __future__ import annotations

import logging
import random
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from nag_lightning.callbacks import FlopAccounting, FlopBudget, RunCheckpoint
from nag_lightning.data import TextDataModule
from nag_lightning.model import TransformerConfig
from nag_lightning.training.module import LanguageModel

SEQ, BATCH = 16, 4

pytestmark = pytest.mark.usefixtures("one_thread")


def model() -> LanguageModel:
    torch.manual_seed(0)
    arch = TransformerConfig(d_model=16, n_layers=1, n_heads=2, seq_len=SEQ)
    return LanguageModel(arch, warmup_steps=1, lr=1e-2)


def loader(batches: int = 20) -> DataLoader:
    data = torch.randint(0, 256, (BATCH * batches, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(data, batch_size=BATCH)


def trainer(tmp_path: Path, callbacks: list, **overrides) -> L.Trainer:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    settings = dict(
        accelerator="cpu", devices=1, max_steps=8, callbacks=callbacks, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        val_check_interval=3, check_val_every_n_epoch=None, limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**settings, **overrides})


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def checkpoint(tmp_path: Path, **kwargs) -> RunCheckpoint:
    settings = dict(dirpath=tmp_path / "ckpt", monitor="val/bpb", save_last=True, save_top_k=1)
    return RunCheckpoint(**{**settings, **kwargs})


class LastCheckpointProbe(L.Callback):
    """Records the step last.ckpt holds at the start of every step."""

    def __init__(self, path: Path) -> None:
        self.path, self.seen = path, {}

    def on_train_batch_start(self, trainer, *args) -> None:
        self.seen[trainer.global_step] = step_of(self.path) if self.path.exists() else None


def test_last_is_rewritten_at_every_validation_and_at_the_end(tmp_path):
    # mode="max" on bits per byte: validation "improves" only the first time, so Lightning alone
    # would have left last.ckpt at step 3.
    probe = LastCheckpointProbe(tmp_path / "ckpt" / "last.ckpt")
    trainer(tmp_path, [probe, checkpoint(tmp_path, mode="max")]).fit(model(), loader(), loader(1))
    assert probe.seen[4] == 3 and probe.seen[7] == 6
    assert step_of(tmp_path / "ckpt" / "last.ckpt") == 8  # max_steps between validations
    [best] = [p for p in (tmp_path / "ckpt").iterdir() if p.name != "last.ckpt"]
    assert step_of(best) == 3


def test_a_flop_budget_stop_is_saved(tmp_path):
    accounting = FlopAccounting()
    probe = FlopAccounting()  # a second counter tells the FLOPs of one step
    one_step = trainer(tmp_path / "probe", [probe], max_steps=1, limit_val_batches=0)
    one_step.fit(model(), loader())
    budget = FlopBudget(budget=4.5 * probe.training_flops)
    run = trainer(tmp_path, [budget, accounting, checkpoint(tmp_path)], max_steps=100, val_check_interval=10)
    run.fit(model(), loader())
    assert run.global_step == budget.stopped_at == 5
    assert step_of(tmp_path / "ckpt" / "last.ckpt") == 5


class Diverge(L.Callback):
    """Makes the weights non-finite at the end of step `step`, before checkpoints are written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == self.step:
            with torch.no_grad():
                pl_module.model.head.weight.fill_(float("nan"))


@pytest.mark.parametrize("diverge_at", [1, 4])
def test_non_finite_states_are_never_written_and_a_nan_stop_names_the_newest_finite_one(
    tmp_path, diverge_at
):
    ckpt = checkpoint(tmp_path, every_n_train_steps=1, monitor=None, save_top_k=-1, filename="step{step}")
    with pytest.raises(FloatingPointError) as error:
        trainer(tmp_path, [Diverge(diverge_at), ckpt], val_check_interval=2).fit(model(), loader(), loader(1))
    written = sorted((tmp_path / "ckpt").glob("*.ckpt")) if (tmp_path / "ckpt").exists() else []
    for path in written:
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        floats = [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point()]
        assert all(torch.isfinite(v).all() for v in floats), path
        assert step_of(path) < diverge_at
    message = str(error.value)
    if diverge_at == 1:
        assert written == []
        assert "no checkpoint was written before the loss diverged" in message
    else:
        last = tmp_path / "ckpt" / "last.ckpt"
        assert step_of(last) == diverge_at - 1
        assert f"resume from the newest finite checkpoint with --ckpt_path {last}." in message


# ---- an exception mid-step, then resume ------------------------------------------------------------


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        self.losses[trainer.global_step] = outputs["loss"].item()


class Interrupt(LanguageModel):
    """Raises inside the forward pass of step `stop_at`, as Ctrl-C mostly does."""

    stop_at = -1

    def training_step(self, batch, batch_idx):
        if self.global_step == self.stop_at:
            raise RuntimeError("interrupted")
        return super().training_step(batch, batch_idx)


def test_an_exception_mid_step_saves_a_state_that_resumes_exactly(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(random.Random(0).choices(range(1, 256), k=3000)))

    def fit(root: Path, stop_at: int = -1, ckpt_path=None) -> dict[int, float]:
        torch.manual_seed(0)
        module = Interrupt(TransformerConfig(d_model=16, n_layers=1, n_heads=2, seq_len=SEQ),
                           warmup_steps=1, lr=1e-2)
        module.stop_at = stop_at
        data = TextDataModule(str(corpus), seq_len=SEQ, batch_size=BATCH, cache_dir=str(tmp_path / "c"))
        record = Record()
        run = trainer(root, [record, checkpoint(root)], max_steps=60, val_check_interval=25)
        try:
            run.fit(module, data, ckpt_path=ckpt_path)
        except RuntimeError as error:
            assert "interrupted" in str(error)
        return record.losses

    straight = fit(tmp_path / "a")
    head = fit(tmp_path / "b", stop_at=13)  # mid-epoch, 12 steps after the last validation
    last = tmp_path / "b" / "ckpt" / "last.ckpt"
    assert max(head) == 13 and step_of(last) == 13
    tail = fit(tmp_path / "b", ckpt_path=last)
    assert min(tail) == 14 and max(tail) == 60  # an epoch is 42 steps: one boundary crossed
    assert {**head, **tail} == straight
