"""Checkpoints of earlier releases go through `nag_lightning.checkpoints.compat` and work in every
command; the class paths earlier runs saved in their configs and checkpoints still resolve."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nag_lightning.checkpoints.compat import MOVED_MODULES, upgrade_checkpoint
from tests.helpers import run_command
from tests.test_checkpoint_settings import data_args, debug_checkpoint, flat_layout, sweeps_and_generates

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml")

SAVED_CLASS_PATHS = (
    "nag_lightning.module.NAGLanguageModel",  # hyper_parameters["_class_path"], config.yaml's model
    "nag_lightning.NAGLanguageModel",
    "nag_lightning.data.ByteDataModule",
    "nag_lightning.ByteDataModule",
    "nag_lightning.tasks.datamodule.TaskDataModule",
    "nag_lightning.callbacks.FlopAccounting",
    "nag_lightning.callbacks.FlopBudget",
    "nag_lightning.callbacks.RunCheckpoint",
    "nag_lightning.callbacks.DepthDiagnostics",
    "nag_lightning.callbacks.WeightProjection",
    "nag_lightning.callbacks.routing.RoutingStats",
    "nag_lightning.residuals.nag.NAGResidual",
    "nag_lightning.routers.threshold.ThresholdRouter",
    "nag_lightning.routers.topk.TopKRouter",
    "nag_lightning.callbacks.checkpoint.RunCheckpoint",
    "nag_lightning.model.Transformer",
    "nag_lightning.model.TransformerConfig",
    "nag_lightning.tokenizer.Tokenizer",
    "nag_lightning.tokenizer.HFTokenizer",
)
"""Class paths the configs, recipes and checkpoints of earlier runs name."""


@pytest.mark.parametrize("path", SAVED_CLASS_PATHS)
def test_class_paths_saved_by_earlier_runs_resolve(path):
    module, _, name = path.rpartition(".")
    assert isinstance(getattr(importlib.import_module(module), name), type)


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_imports_as_the_module_that_replaced_it(old):
    """The same module object, so a class named by its old path is the class the package uses."""
    module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED_MODULES[old])
    assert module.__name__ == module.__spec__.name == MOVED_MODULES[old]


def test_an_old_module_path_imports_in_a_fresh_interpreter():
    """The package installs the alias without importing torch (so `--help` stays fast)."""
    script = ("import sys, nag_lightning\n"
              "assert 'torch' not in sys.modules, 'import nag_lightning imported torch'\n"
              "import nag_lightning.module, nag_lightning.tokenizer\n"
              "from nag_lightning.checkpoint import read_saved\n"
              "print(nag_lightning.module.NAGLanguageModel.__module__, read_saved.__module__)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["nag_lightning.training.module", "nag_lightning.checkpoints.reader"]


def test_a_config_naming_classes_by_their_old_module_paths_still_loads(tmp_path, monkeypatch):
    """What jsonargparse resolves: the data module and a callback saved under their old modules."""
    from nag_lightning.callbacks import RunCheckpoint
    from nag_lightning.cli import run_lightning_cli
    from nag_lightning.data import TextDataModule

    monkeypatch.chdir(tmp_path)
    data = json.dumps({"class_path": "nag_lightning.data.datamodule.ByteDataModule",
                       "init_args": {"source": "corpus.txt", "seq_len": 8}})
    callback = json.dumps([{"class_path": "nag_lightning.callbacks.checkpoint.RunCheckpoint",
                            "init_args": {"save_last": True}}])
    cli = run_lightning_cli(["--config", DEBUG, f"--data={data}", f"--trainer.callbacks={callback}",
                             f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert type(cli.datamodule) is TextDataModule and cli.datamodule.source == "corpus.txt"
    assert any(type(c) is RunCheckpoint for c in cli.trainer.callbacks)


@pytest.fixture(scope="module")
def oldest_checkpoint(tmp_path_factory) -> Path:
    """A NAG checkpoint as the first releases wrote it: the magnitude angle, then the default, so
    not in its options; no settings in the state dict; the architecture flat."""
    root = tmp_path_factory.mktemp("oldest")
    checkpoint = debug_checkpoint(root, "{angle: magnitude, theta_max: 0.25}")
    del checkpoint["state_dict"]["model.strategy._extra_state"]
    checkpoint["hyper_parameters"] = flat_layout(checkpoint["hyper_parameters"])
    assert checkpoint["hyper_parameters"]["residual"]["init_args"] == {"theta_max": 0.25}
    torch.save(checkpoint, root / "oldest.ckpt")
    return root / "oldest.ckpt"


def test_the_reader_completes_the_oldest_nag_state():
    alpha, beta = torch.zeros(4), torch.zeros(4)
    raw = {"hyper_parameters": {"n_layers": 2, "residual": "nag", "residual_options": None},
           "state_dict": {"model.strategy.alpha": alpha, "model.strategy.beta": beta}}
    upgrade_checkpoint(raw)  # the layout stays as saved; the angle of its time is named in it
    assert raw["hyper_parameters"] == {"n_layers": 2, "residual": "nag",
                                       "residual_options": {"angle": "magnitude"}}
    state = raw["state_dict"]  # the settings of the time, split among the parts
    assert state["model.strategy._extra_state"] == {"angle": "magnitude", "bound": "flat",
                                                    "norm_lane_readout": False, "channel_scale": False}
    assert state["model.strategy.angle._extra_state"] == {"saturation": "tanh"}
    assert state["model.strategy.bound._extra_state"] == {"theta_max": 0.5}
    gated = {"hyper_parameters": {"arch": {"residual": "nag", "residual_options": {"gate_reads": "update"}}},
             "state_dict": {"model.strategy._extra_state": {"theta_max": 1.0, "angle": "gate", "norm_lane_readout": True,
                                                           "gate_reads": "update"},
                            "model.strategy.gate_w": alpha, "model.strategy.gate_v": beta}}
    upgrade_checkpoint(gated)
    assert gated["hyper_parameters"]["arch"] == {"residual": "nag", "residual_options": {"angle": "gate_update"}}
    state = gated["state_dict"]
    assert state["model.strategy._extra_state"]["angle"] == "gate_update"
    assert state["model.strategy.angle._extra_state"] == {"gate_gain": "sqrt_d", "gate_radial": False,
                                                          "angle_cost": 0.0}
    assert state["model.strategy.angle.gate_w"] is alpha and state["model.strategy.angle.gate_v"] is beta
    current = {"hyper_parameters": {"arch": {"residual": "nag"}}, "state_dict": dict(state)}
    upgrade_checkpoint(current)  # a checkpoint of the current format is left as it is
    assert current["state_dict"] == state and current["hyper_parameters"] == {"arch": {"residual": "nag"}}


def test_the_options_of_earlier_nag_checkpoints_read_in_the_current_names():
    from nag_lightning.checkpoints.compat import current_nag_options

    assert current_nag_options({"bound_schedule": "flat", "gate_gain": "sqrt_d"}, "gate") == {
        "bound": "flat", "gate_gain": "sqrt_d"}
    assert current_nag_options({"learned_bound": True, "bound_schedule": "flat"}, "gate") == {"bound": "learned"}
    assert current_nag_options({"gate_reads": "tangent"}, "gate") == {"angle": "gate_tangent"}
    assert current_nag_options({"angle": "magnitude", "bound": "rational"}, "magnitude") == {
        "angle": "magnitude", "saturation": "rational"}


def test_the_oldest_nag_checkpoint_loads_resumes_sweeps_and_generates(oldest_checkpoint, tmp_path,
                                                                    capsysbinary, monkeypatch):
    from nag_lightning.training.module import LanguageModel

    module = LanguageModel.load_from_checkpoint(oldest_checkpoint)
    strategy = module.model.strategy
    assert (strategy.angle.name, strategy.bound.theta_max, strategy.norm_lane_readout) == ("magnitude", 0.25, False)
    assert not any("gate" in name for name, _ in strategy.named_parameters())
    weights = torch.load(oldest_checkpoint, weights_only=True)["state_dict"]
    torch.testing.assert_close(strategy.alpha, weights["model.strategy.alpha"])
    monkeypatch.chdir(tmp_path)
    status, _, err = run_command(["fit", "--config", DEBUG, *data_args(oldest_checkpoint),
                                  "--trainer.max_steps=3", f"--ckpt_path={oldest_checkpoint}"], capsysbinary)
    assert status == 0, err[-2000:]
    resumed = torch.load(tmp_path / "runs/debug/version_0/checkpoints/last.ckpt", weights_only=True)
    assert resumed["global_step"] == 3
    assert resumed["state_dict"]["model.strategy._extra_state"]["angle"] == "magnitude"
    sweeps_and_generates(oldest_checkpoint, tmp_path, capsysbinary)
