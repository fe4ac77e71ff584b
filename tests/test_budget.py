"""FLOP accounting and the FLOP budget through the real Trainer: the stop step, checkpoints and
resume, and bad input."""

from __future__ import annotations

import csv
import logging
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from nag_lightning.callbacks import FlopAccounting, FlopBudget
from nag_lightning.model import TransformerConfig
from nag_lightning.model.flops import StepFlops, count_flops, reference_training_flops
from nag_lightning.training.module import LanguageModel

SEQ, BATCH, BATCHES = 16, 4, 3  # an epoch is 3 steps
SIGN = "tests.test_flops.SignRouter"  # data-dependent executed counts


def model(router: str = "none") -> LanguageModel:
    torch.manual_seed(0)
    # A constant learning rate after warmup: the cosine schedule would depend on max_steps, so runs
    # with different step limits would train (and route, so spend) differently.
    arch = TransformerConfig(d_model=16, n_layers=2, n_heads=2, seq_len=SEQ, router=router)
    return LanguageModel(arch, warmup_steps=1, lr=1e-2, min_lr_ratio=1.0)


def loader() -> DataLoader:
    """The same (B, T + 1) batches in the same order every epoch and every run."""
    data = torch.randint(0, 256, (BATCH * BATCHES, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return DataLoader(data, batch_size=BATCH)


def trainer(tmp_path: Path, callbacks: list, max_steps: int = 1000, **overrides) -> L.Trainer:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    settings = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, callbacks=callbacks, logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    return L.Trainer(**{**settings, **overrides})


def dense_step_flops(module: LanguageModel) -> int:
    cfg = module.config
    return 3 * count_flops(cfg, [[SEQ] * BATCH] * cfg.n_sublayers, SEQ, [0] * cfg.n_sublayers).forward


def record_totals(accounting: FlopAccounting) -> list[int]:
    totals: list[int] = []
    accounting.add_listener(lambda trainer, acc: totals.append(acc.training_flops))
    return totals


# ---- the stop step ---------------------------------------------------------------------------------


@pytest.mark.parametrize("steps_worth", [2.5, 3.0])
def test_dense_run_stops_at_the_step_that_reaches_the_budget(tmp_path, steps_worth):
    module = model()
    per_step = dense_step_flops(module)
    accounting, budget = FlopAccounting(), FlopBudget(budget=steps_worth * per_step)
    trainer(tmp_path, [budget, accounting]).fit(module, loader())  # budget listed first on purpose
    assert module.trainer.global_step == 3
    assert accounting.training_flops == 3 * per_step
    assert accounting.tokens == 3 * BATCH * SEQ
    assert budget.stopped_at == 3 and budget.spent == 3 * per_step


def test_routed_run_stops_at_the_first_step_whose_total_reaches_the_budget(tmp_path):
    module = model(SIGN)
    accounting = FlopAccounting()
    totals = record_totals(accounting)
    trainer(tmp_path, [accounting], max_steps=8).fit(module, loader())
    steps = [b - a for a, b in zip([0, *totals], totals)]
    assert len(set(steps)) > 1  # the executed counts, and so the step costs, really vary
    budget_value = (totals[4] + totals[5]) / 2  # reached by the 6th step, not the 5th

    module = model(SIGN)
    accounting, budget = FlopAccounting(), FlopBudget(budget=budget_value)
    trainer(tmp_path, [accounting, budget]).fit(module, loader())
    assert module.trainer.global_step == 6
    assert accounting.training_flops == totals[5]


def test_reference_tokens_budget_is_the_full_depth_baseline(tmp_path):
    module = model()  # full depth itself: it must stop once it has seen the reference tokens
    tokens = 5 * BATCH * SEQ - 7
    accounting, budget = FlopAccounting(), FlopBudget(reference_tokens=tokens)
    trainer(tmp_path, [accounting, budget]).fit(module, loader())
    assert budget.budget == reference_training_flops(module.config, tokens)
    assert module.trainer.global_step == 5
    assert accounting.tokens - BATCH * SEQ < tokens <= accounting.tokens


def test_accounting_reports_executed_fraction_and_parameters(tmp_path):
    module = model(SIGN)
    accounting = FlopAccounting()
    seen: list[dict] = []
    accounting.add_listener(lambda trainer, acc: seen.append(dict(acc.last)))
    trainer(tmp_path, [accounting], max_steps=2).fit(module, loader())
    layer_params = sum(p.numel() for s in module.model.sublayers for p in s.compute.parameters())
    for last in seen:
        assert 0 < last["executed_fraction"] < 1
        assert 0 < last["executed_params_per_token"] < layer_params


def test_gradient_accumulation_counts_every_micro_batch(tmp_path):
    module = model()
    per_batch = dense_step_flops(module)
    accounting = FlopAccounting()
    totals = record_totals(accounting)
    trainer(tmp_path, [accounting], max_steps=2, accumulate_grad_batches=3).fit(module, loader())
    assert totals == [3 * per_batch, 6 * per_batch]  # one entry per optimizer step
    assert accounting.tokens == 6 * BATCH * SEQ


def test_throughput_and_mfu_come_from_lightnings_throughput(tmp_path):
    module = model()
    peak = 1e9
    run = trainer(tmp_path, [FlopAccounting(peak_flops=peak, window_size=2)], max_steps=4,
                  log_every_n_steps=1, logger=CSVLogger(tmp_path, name="mfu", version=0))
    run.fit(module, loader())
    with open(tmp_path / "mfu" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("throughput/device/mfu")]
    assert len(rows) == 3  # once the window of 2 steps is full: steps 2, 3 and 4
    for row in rows:
        flops_per_sec = float(row["throughput/device/flops_per_sec"])
        assert float(row["throughput/device/mfu"]) == pytest.approx(flops_per_sec / peak)
        seconds_per_step = 1 / float(row["throughput/device/batches_per_sec"])
        assert flops_per_sec * seconds_per_step == pytest.approx(dense_step_flops(module))
        assert float(row["throughput/device/tokens_per_sec"]) * seconds_per_step == pytest.approx(BATCH * SEQ)


class Linear(L.LightningModule):
    """Not a nag_lightning model, and without a counter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(SEQ + 1, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch.float()).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class CountedLinear(Linear):
    """The same, reporting its FLOPs through `flop_counter()`."""

    def flop_counter(self):
        class Counter:
            def step(self) -> StepFlops:
                return StepFlops(forward=2 * BATCH * (SEQ + 1), layer=1.0, full_depth_layer=2.0,
                                 executed_params=BATCH * (SEQ + 1), tokens=BATCH, samples=BATCH)

        return Counter()


def test_any_lightning_module_can_be_counted_through_flop_counter(tmp_path):
    accounting = FlopAccounting()
    seen: list[dict] = []
    accounting.add_listener(lambda trainer, acc: seen.append(dict(acc.last)))
    trainer(tmp_path, [accounting], max_steps=3).fit(CountedLinear(), loader())
    assert accounting.training_flops == 3 * 3 * 2 * BATCH * (SEQ + 1)
    assert seen[-1]["executed_fraction"] == 0.5 and seen[-1]["executed_params_per_token"] == SEQ + 1


def test_a_module_without_a_counter_is_measured(tmp_path):
    accounting = FlopAccounting()
    trainer(tmp_path, [accounting], max_steps=3).fit(Linear(), loader())
    # by hand: the (B, SEQ + 1) x (SEQ + 1, 1) product forward, and the weight's gradient backward
    # (the input needs none)
    assert accounting.forward_flops == 3 * 2 * BATCH * (SEQ + 1)
    assert accounting.training_flops == 3 * 4 * BATCH * (SEQ + 1)
    assert accounting.tokens == 3 * BATCH * SEQ  # targets: batch[:, 1:]


# ---- checkpoints and resume ------------------------------------------------------------------------


def test_stop_and_resume_spends_the_same_as_an_uninterrupted_run(tmp_path):
    # Step costs of a routed model, whose executed counts (so step costs) vary with the data.
    module = model(SIGN)
    accounting = FlopAccounting()
    totals = record_totals(accounting)
    trainer(tmp_path, [accounting], max_steps=8).fit(module, loader())
    budget_value = (totals[6] + totals[7]) / 2  # reached by the 8th step

    # Uninterrupted, checkpointing every epoch (3 steps) as a long run would.
    module = model(SIGN)
    accounting, budget = FlopAccounting(), FlopBudget(budget=budget_value)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1,
                                  filename="{step}")
    trainer(tmp_path, [accounting, budget, checkpoints]).fit(module, loader())
    whole = {k: v.clone() if torch.is_tensor(v) else v for k, v in module.state_dict().items()}
    assert module.trainer.global_step == 8 and accounting.training_flops == totals[7]
    ckpt = tmp_path / "ckpt" / "step=3.ckpt"
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["FlopAccounting"]
    assert 3 * saved["forward_flops"] == totals[2]

    # Interrupted after step 3: a fresh process resumes from that checkpoint.
    module = model(SIGN)
    accounting, budget = FlopAccounting(), FlopBudget(budget=budget_value)
    resumed_steps = record_totals(accounting)
    trainer(tmp_path / "resumed", [accounting, budget]).fit(module, loader(), ckpt_path=ckpt)
    assert resumed_steps == totals[3:8]  # only the remainder was spent, step by step the same
    assert module.trainer.global_step == 8 and budget.stopped_at == 8
    for name, value in module.state_dict().items():
        if not torch.is_tensor(value):  # a module's extra state, e.g. NAG's settings
            assert value == whole[name], name
            continue
        torch.testing.assert_close(value, whole[name], rtol=0, atol=0, msg=f"{name} differs")


def test_resuming_a_run_that_already_spent_its_budget_trains_no_further(tmp_path):
    module = model()
    per_step = dense_step_flops(module)
    first = trainer(tmp_path, [FlopAccounting(), FlopBudget(budget=2 * per_step)])
    first.fit(module, loader())
    ckpt = tmp_path / "done.ckpt"
    first.save_checkpoint(ckpt)

    module = model()
    accounting = FlopAccounting()
    resumed_steps = record_totals(accounting)
    trainer(tmp_path, [accounting, FlopBudget(budget=2 * per_step)]).fit(module, loader(), ckpt_path=ckpt)
    assert resumed_steps == [] and module.trainer.global_step == 2
    assert accounting.training_flops == 2 * per_step


# ---- bad input -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"budget": 0}, "positive"),
    ({"budget": -1e12}, "positive"),
    ({"reference_tokens": 0}, "positive"),
    ({}, "exactly one"),
    ({"budget": 1e12, "reference_tokens": 1000}, "exactly one"),
])
def test_budget_must_be_positive_and_given_once(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FlopBudget(**kwargs)


def test_budget_smaller_than_one_step_is_refused_not_silently_stopped(tmp_path):
    module = model()
    per_step = dense_step_flops(module)
    run = trainer(tmp_path, [FlopAccounting(), FlopBudget(budget=0.4 * per_step)])
    with pytest.raises(ValueError, match="smaller than one training step"):
        run.fit(module, loader())


def test_budget_without_accounting_says_what_to_add(tmp_path):
    with pytest.raises(ValueError, match="FlopAccounting"):
        trainer(tmp_path, [FlopBudget(budget=1e12)]).fit(model(), loader())


def test_accounting_options_are_checked():
    with pytest.raises(ValueError, match="peak_flops"):
        FlopAccounting(peak_flops=0)
    with pytest.raises(ValueError, match="window_size"):
        FlopAccounting(window_size=1)


# ---- the comparison of finished runs ---------------------------------------------------------------


def test_compare_reads_finished_runs(tmp_path, capsys):
    from nag_lightning.analysis.reports.compare import compare_command

    finished = {}
    for name, router in (("dense", "none"), ("routed", SIGN)):
        module = model(router)
        accounting = FlopAccounting()
        run = trainer(tmp_path, [accounting], max_steps=6, limit_val_batches=1, val_check_interval=3,
                      log_every_n_steps=2, logger=CSVLogger(tmp_path / "runs", name=name))
        run.fit(module, loader(), loader())
        val_bpb = float(run.callback_metrics["val/bpb"])
        finished[name] = (accounting.training_flops, accounting.tokens, val_bpb)
    compare_command([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    with open(tmp_path / "out" / "compare.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"dense", "routed"} and "| routed |" in printed
    for name, (flops, tokens, bpb) in finished.items():
        assert float(rows[name]["training_flops"]) == flops
        assert int(rows[name]["tokens"]) == tokens
        assert float(rows[name]["final_val_bpb"]) == pytest.approx(bpb)
    assert float(rows["routed"]["executed_fraction"]) < 1 == float(rows["dense"]["executed_fraction"])
    assert (tmp_path / "out" / "compare.png").stat().st_size > 10_000
    assert (tmp_path / "out" / "compare.md").read_text().count("\n") == 4


def test_compare_says_what_is_missing(tmp_path):
    from nag_lightning.analysis.reports.compare import compare

    with pytest.raises(FileNotFoundError, match="metrics.csv"):
        compare([tmp_path])


def test_compare_shows_a_run_without_flop_totals_with_dashes(tmp_path, capsys):
    from nag_lightning.analysis.reports.compare import compare_command

    counted, uncounted = tmp_path / "runs" / "counted", tmp_path / "runs" / "uncounted"
    counted.mkdir(parents=True)
    uncounted.mkdir()
    (counted / "metrics.csv").write_text(
        "step,flops/total,flops/tokens,val/bpb\n4,3.0e9,640,\n9,6.0e9,1280,\n9,,,2.5\n")
    (uncounted / "metrics.csv").write_text("step,train/loss,val/bpb\n4,2.0,\n9,1.9,\n9,,2.75\n")
    compare_command([str(tmp_path / "runs"), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert "| counted | ? | ? | 10 | 1,280 | 6e+09 |" in printed
    assert "| uncounted | ? | ? | 10 | - | - | - | - | - | 2.7500 |" in printed
    assert "no FLOP totals ('-') for uncounted" in printed
    with open(tmp_path / "out" / "compare.csv") as f:
        rows = {r["run"]: r for r in csv.DictReader(f)}
    assert rows["uncounted"]["training_flops"] == rows["uncounted"]["tokens"] == ""
    assert float(rows["uncounted"]["final_val_bpb"]) == 2.75 and rows["counted"]["tokens"] == "1280"
