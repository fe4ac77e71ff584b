"""A residual strategy and a router written outside the package, named by class path and registered
nowhere, go through every command: fit, validate, sweep, generate, compare and the studies' runs.
This is what the extending checklists of docs/extending.md and docs/routing.md promise."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

from tests.helpers import run_command

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml")

PLUGINS = '''
"""Plugins of another package: a damped pre-norm stream and a router with its own sweep knob."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from nag_lightning.residuals.prenorm import PreNormResidual
from nag_lightning.routers import Route, Router


class DampedPreNorm(PreNormResidual):
    """Pre-norm whose every write is scaled by `damping`.

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers.
        damping: factor on every write.
    """

    def __init__(self, d_model: int, n_sublayers: int, damping: float = 1.0) -> None:
        super().__init__(d_model, n_sublayers)
        self.damping = damping

    def write(self, state, f, gate, index, need_angle=True):
        return super().write(state, self.damping * f, gate, index, need_angle)


class ScoreRouter(Router):
    """A token runs when sigmoid(<w, h>) reaches `keep_above`, and writes with that gate.

    Args:
        d_model: width of the read input.
        keep_above: the gate a token needs to run, in [0, 1].
    """

    sweep_setting = "keep_above"

    def __init__(self, d_model: int, keep_above: float = 0.5) -> None:
        super().__init__(d_model)
        self.keep_above = keep_above
        self.score = nn.Linear(d_model, 1, bias=False)

    def forward(self, h: Tensor) -> Route:
        gate = torch.sigmoid(self.score(h).squeeze(-1))  # (B, T), each token's own
        return Route(executed=gate >= self.keep_above, gate=gate)

    def flops_per_token(self) -> int:
        return 2 * self.d_model

    @contextmanager
    def sweeping(self, value: float) -> Iterator[None]:
        trained, self.keep_above = self.keep_above, value
        try:
            yield
        finally:
            self.keep_above = trained

    @classmethod
    def default_sweep_values(cls, routers, inputs):
        return [0.0, 0.5, 1.01]
'''

RESIDUAL = "outside_plugins.DampedPreNorm"
ROUTER = "outside_plugins.ScoreRouter"


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    """A folder holding the plugin module, on sys.path (as an installed package would be) for the
    commands this process runs, and the working folder of the runs."""
    root = tmp_path_factory.mktemp("outside")
    (root / "outside_plugins.py").write_text(PLUGINS)
    source = Path(__file__).resolve().parents[1] / "nag_lightning" / "model" / "transformer.py"
    (root / "corpus.txt").write_text(source.read_text() * 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        patch.chdir(root)
        yield root
    sys.modules.pop("outside_plugins", None)


def plugin_args(root: Path) -> list[str]:
    return ["--model.arch.residual", RESIDUAL, "--model.arch.residual_options", "{damping: 0.5}",
            "--model.arch.router", ROUTER, "--model.arch.router_options", "{keep_above: 0.45}",
            f"--data.source={root / 'corpus.txt'}", f"--data.cache_dir={root / 'cache'}",
            "--data.max_bytes=null", "--trainer.enable_progress_bar=false"]


@pytest.fixture(scope="module")
def trained(outside) -> Path:
    """The run folder of a few steps of `fit` with both plugins."""
    import torch

    from nag_lightning.cli import main

    main(["fit", "--config", DEBUG, *plugin_args(outside), "--trainer.max_steps=4"])
    run = outside / "runs" / "debug" / "version_0"
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert saved["arch"]["residual"] == RESIDUAL and saved["arch"]["router"] == ROUTER
    assert saved["arch"]["router_options"] == {"keep_above": 0.45}
    return run


def test_fit_and_validate_with_plugins_named_by_class_path(trained, outside, capsys):
    assert (trained / "metrics.csv").is_file()
    ckpt = str(trained / "checkpoints" / "last.ckpt")
    # the user's own config names the same class paths: no trust flag needed
    status, out, err = run_command(["validate", "--config", DEBUG, *plugin_args(outside),
                                    f"--ckpt_path={ckpt}"], capsys)
    assert status == 0, err[-2000:]
    assert "val/bpb" in out


def test_a_plugin_checkpoint_needs_trust_to_sweep_and_generate(trained, capsys):
    ckpt = str(trained / "checkpoints" / "last.ckpt")
    status, _, err = run_command(["generate", f"--ckpt_path={ckpt}", "--max_new_tokens=2"], capsys)
    assert status == 1 and "no registry knows" in err and "--trust_checkpoint" in err


def test_sweep_varies_the_outside_routers_own_setting(trained, outside, capsys):
    ckpt = str(trained / "checkpoints" / "last.ckpt")
    status, out, err = run_command(["sweep", f"--ckpt_path={ckpt}", "--trust_checkpoint=true",
                                    "--val_batches=1", f"--out_dir={outside / 'sweep'}"], capsys)
    assert status == 0, err[-2000:]
    with open(outside / "sweep" / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["method"], r["setting"], float(r["value"])) for r in rows] == [
        ("ScoreRouter", "keep_above", 0.0), ("ScoreRouter", "keep_above", 0.5),
        ("ScoreRouter", "keep_above", 1.01)]  # its defaults; no oracle: the setting is no angle
    rates = [float(r["mod_rate"]) for r in rows]
    assert rates[0] == 0 and rates[-1] == 1  # a gate of at least 0 runs all, above 1 none
    assert float(rows[-1]["flops_per_token"]) < float(rows[0]["flops_per_token"])
    status, _, err = run_command(["sweep", f"--ckpt_path={ckpt}", "--trust_checkpoint=true",
                                  "--val_batches=1", f"--out_dir={outside / 'sweep2'}",
                                  "--values=[0.3]"], capsys)
    assert status == 0, err[-2000:]
    with open(outside / "sweep2" / "sweep.csv") as f:
        assert [float(r["value"]) for r in csv.DictReader(f)] == [0.3]


def test_generate_with_the_plugins(trained, capsysbinary):
    ckpt = str(trained / "checkpoints" / "last.ckpt")
    for cache in ("true", "false"):
        status, out, err = run_command(["generate", f"--ckpt_path={ckpt}", "--trust_checkpoint=true",
                                        "--max_new_tokens=4", f"--cache={cache}"], capsysbinary)
        assert status == 0, err[-2000:]
        assert "sublayers executed per generated byte" in out


def test_compare_names_the_plugins(trained, outside, capsys):
    status, out, err = run_command(["compare", str(trained), "--out", str(outside / "compare")], capsys)
    assert status == 0, err[-2000:]
    assert RESIDUAL in out and f"{ROUTER} keep_above=0.45" in out


def test_the_studies_run_and_read_plugin_runs(outside, monkeypatch):
    from nag_lightning.analysis.studies import isoflop as isoflop_study
    from nag_lightning.analysis.studies import study
    from nag_lightning.analysis.studies import tradeoff as tradeoff_study
    from tests.test_study import InProcess

    monkeypatch.setattr(study, "subprocess", InProcess)
    steps = ["--trainer.max_steps=3", "--trainer.val_check_interval=3"]
    extra = plugin_args(outside)[2:] + steps
    row = study.run_one(DEBUG, outside / "depth", RESIDUAL, 1, 1, extra, lr=1e-3, split_batches=2,
                        trust_checkpoint=True)
    assert row["residual"] == RESIDUAL and row["select_bpb"] > 0 and row["report_bpb"] > 0
    rows = tradeoff_study.sweep_run(outside / "depth" / study.run_name(RESIDUAL, 1, 1, 1e-3) / "version_0"
                                    / "checkpoints" / "last.ckpt", outside / "tradeoff", 1, 1,
                                    trust_checkpoint=True)
    assert {r["method"] for r in rows} == {"ScoreRouter"}
    result = isoflop_study.run_recipe(Path(DEBUG), outside / "isoflop", 1, plugin_args(outside) + steps)
    assert result["residual"] == RESIDUAL and result["training_flops"] > 0
