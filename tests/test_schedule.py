"""Learning-rate schedules: cosine over the steps, and warmup-stable-decay (WSD) whose decay fills
the last fraction of a FLOP budget; the same learning rates after a resume."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from nag_lightning.callbacks import FlopAccounting, FlopBudget
from nag_lightning.model import TransformerConfig
from nag_lightning.training.module import LanguageModel
from nag_lightning.training.module import __file__ as module_file
from nag_lightning.training.optim import warmup_stable_decay
from tests.test_budget import SIGN, dense_step_flops, loader, trainer

ROOT = Path(__file__).resolve().parents[1]
LR, WARMUP, MIN_RATIO = 1e-2, 2, 0.1

pytestmark = pytest.mark.usefixtures("one_thread")


def model(router: str = "none", **schedule) -> LanguageModel:
    torch.manual_seed(0)
    settings = {"schedule": "wsd", "warmup_steps": WARMUP, "min_lr_ratio": MIN_RATIO, **schedule}
    arch = TransformerConfig(d_model=16, n_layers=2, n_heads=2, seq_len=16, router=router)
    return LanguageModel(arch, lr=LR, **settings)


class RecordLR(L.Callback):
    """The learning rate each optimizer step trains with."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def test_warmup_stable_decay_factor():
    assert warmup_stable_decay(0, 4, 0.0, 0.2, 0.1) == 0.25  # warmup is counted in steps
    assert warmup_stable_decay(3, 4, 0.9, 0.2, 0.1) == 1.0
    assert warmup_stable_decay(10, 4, 0.8, 0.2, 0.1) == 1.0  # stable up to 1 - decay_fraction
    assert warmup_stable_decay(10, 4, 0.9, 0.2, 0.1) == pytest.approx(0.55)  # linear
    assert warmup_stable_decay(10, 4, 1.0, 0.2, 0.1) == pytest.approx(0.1)
    assert warmup_stable_decay(10, 0, 1.3, 0.2, 0.1) == pytest.approx(0.1)  # never below min


def test_wsd_decays_over_the_last_fraction_of_the_flop_budget(tmp_path):
    module = model(decay_fraction=0.5)
    per_step = dense_step_flops(module)
    record = RecordLR()
    trainer(tmp_path, [FlopAccounting(), FlopBudget(budget=10 * per_step), record]).fit(module, loader())
    assert module.trainer.global_step == 10  # the budget, not max_steps (1000), ends the run
    # Lightning steps the scheduler before the step's FLOPs are counted, so step k + 1 trains at the
    # factor of progress after step k - 1: stable through half the budget, then linear to the end.
    expected = [LR * warmup_stable_decay(k, WARMUP, max(k - 1, 0) / 10, 0.5, MIN_RATIO)
                for k in range(10)]
    assert record.lrs == pytest.approx(expected)
    assert record.lrs[1:7] == pytest.approx([LR] * 6)
    assert all(a > b for a, b in zip(record.lrs[6:], record.lrs[7:]))


def test_without_a_budget_wsd_decays_over_the_last_fraction_of_the_steps(tmp_path):
    module = model(decay_fraction=0.3, warmup_steps=0)
    record = RecordLR()
    trainer(tmp_path, [record], max_steps=10).fit(module, loader())
    expected = [LR * warmup_stable_decay(k, 0, k / 10, 0.3, MIN_RATIO) for k in range(10)]
    assert record.lrs == pytest.approx(expected)
    assert record.lrs[:8] == pytest.approx([LR] * 8) and record.lrs[9] < record.lrs[8] < LR


def test_the_module_follows_a_budget_only_in_the_run_that_has_one(tmp_path):
    """The budget tells the module (`follow_budget`); the module looks for no callback, and a later
    run without a budget decays over its steps again."""
    module = model(decay_fraction=0.3, warmup_steps=0)
    per_step = dense_step_flops(module)
    trainer(tmp_path / "budget", [FlopAccounting(), FlopBudget(budget=2 * per_step)]).fit(module, loader())
    assert module.trainer.global_step == 2 and module.budget is None  # forgotten at teardown
    record = RecordLR()
    trainer(tmp_path / "steps", [record], max_steps=10).fit(module, loader())
    assert record.lrs == pytest.approx([LR * warmup_stable_decay(k, 0, k / 10, 0.3, MIN_RATIO)
                                        for k in range(10)])
    imports = {node.module or "" for node in ast.walk(ast.parse(Path(module_file).read_text()))
               if isinstance(node, ast.ImportFrom)}
    assert not [name for name in imports if name.startswith("nag_lightning.callbacks")]


def test_a_resumed_run_follows_the_same_learning_rates(tmp_path):
    # A routed model: step costs, so the budget's progress, depend on the data.
    module = model(SIGN, decay_fraction=0.5)
    accounting = FlopAccounting()
    totals: list[int] = []
    accounting.add_listener(lambda trainer, acc: totals.append(acc.training_flops))
    trainer(tmp_path, [accounting], max_steps=9).fit(module, loader())
    budget = (totals[7] + totals[8]) / 2  # reached by the 9th step

    whole = RecordLR()
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1,
                                  filename="{step}")
    trainer(tmp_path, [FlopAccounting(), FlopBudget(budget=budget), whole, checkpoints]).fit(
        model(SIGN, decay_fraction=0.5), loader())
    assert len(whole.lrs) == 9 and whole.lrs[-1] < whole.lrs[4]  # it decayed

    # Interrupted after step 6, already decaying: a fresh process resumes from that checkpoint.
    resumed = RecordLR()
    module = model(SIGN, decay_fraction=0.5)
    trainer(tmp_path / "resumed", [FlopAccounting(), FlopBudget(budget=budget), resumed]).fit(
        module, loader(), ckpt_path=tmp_path / "ckpt" / "step=6.ckpt")
    assert module.trainer.global_step == 9
    assert resumed.lrs == whole.lrs[6:]  # exactly, not approximately


def test_cosine_under_a_budget_says_it_decays_over_the_steps(tmp_path):
    module = model(schedule="cosine")
    budget = FlopBudget(budget=2 * dense_step_flops(module))
    with pytest.warns(UserWarning, match="set model.schedule: wsd"):
        trainer(tmp_path, [FlopAccounting(), budget]).fit(module, loader())


def test_schedule_settings_are_checked():
    with pytest.raises(ValueError, match="model.schedule must be one of cosine, wsd"):
        LanguageModel(schedule="linear")
    with pytest.raises(ValueError, match=r"model.decay_fraction in \(0, 1\]"):
        LanguageModel(schedule="wsd", decay_fraction=0.0)


def test_isoflop_recipes_anneal_at_the_end_of_their_budget():
    from nag_lightning.analysis.studies.isoflop import DEFAULT_RECIPES

    recipes = sorted((ROOT / "recipes" / "isoflop").glob("*.yaml"))
    assert sorted(r.stem for r in recipes) == sorted(DEFAULT_RECIPES)  # the study runs every one
    for recipe in recipes:
        config = yaml.safe_load(recipe.read_text())
        model_config = config["model"]
        assert model_config["schedule"] == "wsd" and model_config["decay_fraction"] == 0.2, recipe
        assert model_config["min_lr_ratio"] < 1, recipe
        assert any(c["class_path"].endswith("FlopBudget") for c in config["trainer"]["callbacks"])


def test_training_updates_with_fused_adamw_where_lightning_allows_it(tmp_path):
    """Fused AdamW (one kernel for every parameter) on plain CPU parameters; the default where
    Lightning's mixed precision would clip gradients, which it refuses for an optimizer that
    unscales them itself."""
    module = model()
    fit = trainer(tmp_path, [], max_steps=2)
    fit.fit(module, loader())
    assert fit.optimizers[0].defaults["fused"] is True
    assert torch.isfinite(next(module.parameters())).all()
    mixed = trainer(tmp_path, [], max_steps=2, precision="bf16-mixed", gradient_clip_val=1.0)
    mixed.fit(model(), loader())
    assert not mixed.optimizers[0].defaults["fused"]
