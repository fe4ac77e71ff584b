"""Scale-out on CPU: bf16 mixed precision, DDP across two processes (gloo) with FLOP accounting,
and every iso-FLOP and scale-out recipe against the CLI.

Run as a module (`python -m tests.test_scale OUT_DIR`) this file is the DDP worker: Lightning
starts the second rank by running the same command again.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader

from nag_lightning.callbacks import FlopAccounting, FlopBudget
from nag_lightning.cli import run_lightning_cli
from nag_lightning.model import TransformerConfig
from nag_lightning.model.flops import reference_training_flops
from nag_lightning.training.module import LanguageModel

ROOT = Path(__file__).resolve().parents[1]
SCALE = sorted((ROOT / "recipes" / "scale").glob("*.yaml"))
ISOFLOP = sorted((ROOT / "recipes" / "isoflop").glob("*.yaml"))
SEQ, BATCH = 16, 4
SIGN = "tests.test_flops.SignRouter"  # data-dependent executed counts


def model(router: str = "none", lr: float = 3e-3) -> LanguageModel:
    torch.manual_seed(0)
    arch = TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=SEQ, router=router)
    return LanguageModel(arch, warmup_steps=1, lr=lr)


def loader(samples: int = 32) -> DataLoader:
    """Counting sequences from random starts: learnable in a few steps, so training shows."""
    starts = torch.randint(0, 256, (samples, 1), generator=torch.Generator().manual_seed(1))
    return DataLoader((starts + torch.arange(SEQ + 1)) % 256, batch_size=BATCH)


def quiet() -> None:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    """LightningCLI reads sys.argv too; keep pytest's own arguments out of it."""
    monkeypatch.setattr(sys, "argv", ["nag-lightning"])


class Record(L.Callback):
    """The loss of every step and the dtype the LM head computed in."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.head_dtypes: set[torch.dtype] = set()

    def on_fit_start(self, trainer, pl_module) -> None:
        pl_module.model.head.register_forward_hook(
            lambda module, args, out: self.head_dtypes.add(out.dtype))

    def on_train_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        self.losses.append(float(outputs["loss"]))


# ---- bf16 mixed precision ---------------------------------------------------------------------------


def test_bf16_mixed_on_cpu_tracks_fp32(tmp_path):
    quiet()
    runs = {}
    for precision in ("32-true", "bf16-mixed"):
        module = model(lr=2e-2)
        record, accounting = Record(), FlopAccounting()
        L.Trainer(accelerator="cpu", precision=precision, max_steps=10, callbacks=[record, accounting],
                  logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0, default_root_dir=tmp_path,
                  ).fit(module, loader())
        runs[precision] = (record, accounting.training_flops)
    fp32, bf16 = runs["32-true"][0], runs["bf16-mixed"][0]
    assert fp32.head_dtypes == {torch.float32} and bf16.head_dtypes == {torch.bfloat16}
    assert all(map(torch.isfinite, map(torch.tensor, bf16.losses)))
    # within 3%: at this learning rate bf16's rounding compounds, and NAG's default (the slow,
    # unpriced gate) ends 2.0% apart at step 9 (the fast priced gate stayed under 2%)
    for step, (a, b) in enumerate(zip(fp32.losses, bf16.losses)):
        assert abs(a - b) < 0.03 * a, f"step {step}: fp32 loss {a:.4f}, bf16-mixed {b:.4f}"
    assert bf16.losses[-1] < bf16.losses[0] - 1.0  # it trained
    assert runs["32-true"][1] == runs["bf16-mixed"][1]  # same work counted in either precision


# ---- DDP, two processes, gloo -----------------------------------------------------------------------


def ddp_worker(out: Path) -> None:
    """Both ranks run this; Lightning's launcher starts rank 1 with the same command line."""
    quiet()
    module = model(SIGN)
    accounting = FlopAccounting()
    budget = FlopBudget(reference_tokens=2 * 3 * BATCH * SEQ + 1)  # a little past 3 dense steps
    steps: list[int] = []
    accounting.add_listener(lambda trainer, acc: steps.append(acc.local_forward_flops))
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=20, callbacks=[accounting, budget],
        logger=L.pytorch.loggers.CSVLogger(out, name="ddp", version=0), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, default_root_dir=out,
    )
    trainer.fit(module, loader())
    rank = trainer.global_rank
    torch.save(module.state_dict(), out / f"rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({
        "local_forward": accounting.local_forward_flops, "local_steps": steps,
        "training_flops": accounting.training_flops, "tokens": accounting.tokens,
        "global_step": trainer.global_step, "budget": budget.budget,
    }))


def two_rank_reports(worker_module: str, out: Path, timeout: float = 240) -> list[dict]:
    """Run `python -m worker_module OUT` (Lightning starts the second rank) and read the
    `rank{0,1}.json` each rank wrote into OUT."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    result = subprocess.run([sys.executable, "-m", worker_module, str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_ddp_two_processes_sum_flops_and_agree_on_weights(tmp_path):
    ranks = two_rank_reports("tests.test_scale", tmp_path)
    # The routed counts depend on each rank's data, so the ranks did different work ...
    assert ranks[0]["local_forward"] != ranks[1]["local_forward"]
    # ... and the logged global total is the sum of both, step by step and in the end.
    with open(tmp_path / "ddp" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("flops/total")]
    logged = [int(float(r["flops/total"])) for r in rows]
    per_step = [3 * (a + b) for a, b in zip(ranks[0]["local_steps"], ranks[1]["local_steps"])]
    assert logged == per_step
    assert ranks[0]["training_flops"] == ranks[1]["training_flops"] == per_step[-1]
    assert ranks[0]["tokens"] == len(per_step) * 2 * BATCH * SEQ
    # Both ranks stopped at the same step, the first whose global total reaches the budget.
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == len(per_step) < 20
    assert per_step[-2] < ranks[0]["budget"] <= per_step[-1]
    weights = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    for name, value in weights[0].items():
        same = torch.equal(value, weights[1][name]) if torch.is_tensor(value) else value == weights[1][name]
        assert same, f"{name} differs across ranks"


# ---- recipes ----------------------------------------------------------------------------------------


def printed_config(recipe: Path, capsys) -> dict:
    """The recipe as LightningCLI parses and validates it (`fit --print_config`), without training."""
    with pytest.raises(SystemExit) as exit_:
        run_lightning_cli(args=["fit", "--config", str(recipe), "--print_config"])
    out = capsys.readouterr().out
    assert exit_.value.code in (0, None), out
    return yaml.safe_load(out)


def callback_args(config: dict, name: str) -> dict | None:
    for callback in config["trainer"].get("callbacks") or []:
        if callback["class_path"].endswith(name):
            return callback.get("init_args") or {}
    return None


@pytest.mark.parametrize("recipe", SCALE + ISOFLOP, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_recipe_parses_with_flop_accounting_and_budget(recipe, capsys):
    config = printed_config(recipe, capsys)
    assert callback_args(config, "FlopAccounting") is not None
    budget = callback_args(config, "FlopBudget")
    assert budget is not None and (budget["budget"] or budget["reference_tokens"])


def test_scale_recipes_say_what_they_claim(capsys):
    configs = {p.stem: printed_config(p, capsys)["trainer"] for p in SCALE}
    assert set(configs) >= {"gpu_bf16", "ddp", "fsdp", "multinode"}
    assert all(t["precision"] == "bf16-mixed" and t["accelerator"] == "gpu" for t in configs.values())
    assert configs["gpu_bf16"]["devices"] == 1
    assert configs["ddp"]["strategy"] == "ddp"
    assert configs["multinode"]["num_nodes"] > 1
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import FSDPStrategy, Strategy

    from nag_lightning.model import Block

    for name in ("fsdp", "multinode"):
        # Build the strategy as LightningCLI would (no process group is started on construction).
        parser = ArgumentParser()
        parser.add_argument("--strategy", type=str | Strategy)
        parsed = parser.parse_object({"strategy": configs[name]["strategy"]})
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        strategy = instantiate(parsed).strategy
        assert isinstance(strategy, FSDPStrategy)
        assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block}


def test_isoflop_recipes_share_parameters_and_budget(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    quiet()
    seen = {}
    for recipe in ISOFLOP:
        cli = run_lightning_cli(args=["--config", str(recipe)], run=False)
        module, trainer = cli.model, cli.trainer
        budget = next(c for c in trainer.callbacks if isinstance(c, FlopBudget))
        assert any(isinstance(c, FlopAccounting) for c in trainer.callbacks)
        layer_params = sum(p.numel() for s in module.model.sublayers for p in s.compute.parameters())
        flops = reference_training_flops(module.config, budget.reference_tokens)
        step_tokens = cli.datamodule.batch_size * module.config.seq_len
        dense_step = reference_training_flops(module.config, step_tokens)
        assert trainer.max_steps > 10 * flops / dense_step  # the budget, not max_steps, ends the run
        rate = {"none": 0.0}.get(module.config.router)
        if module.config.router == "topk":
            rate = 1 - module.config.router_options["capacity"]
        elif module.config.router == "threshold":
            rate = module.config.router_options["target_rate"]
        seen[recipe.stem] = (layer_params, flops, module.config.residual, round(rate, 2))
    assert len({(p, f) for p, f, *_ in seen.values()}) == 1, seen  # same parameters, same budget
    runs = {(residual, rate) for *_, residual, rate in seen.values()}
    assert {("prenorm", 0.0), ("nag", 0.0), ("nag", 0.2), ("nag", 0.25)} <= runs


if __name__ == "__main__":
    ddp_worker(Path(sys.argv[1]))
