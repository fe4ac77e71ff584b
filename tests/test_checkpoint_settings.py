"""Checkpoints and configs written before the architecture moved under `model.arch` still work:
old checkpoints load in every command, old configs are refused with one sentence that says how to
map them, and a class path saved in either layout still needs trust."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nag_lightning.checkpoints.settings import saved_architecture, saved_model_settings
from tests.helpers import run_command

DEBUG = str(Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml")


def flat_layout(saved: dict) -> dict:
    """Hyperparameters as the release before `model.arch` saved them: the architecture flat among
    the training settings, unset options as None, the plugin as a {class_path, init_args} mapping."""
    arch = dict(saved.pop("arch"))
    arch.pop("rope_base")  # not saved then
    arch.update(route_kinds=None, router_options=None, residual_options=None)
    arch["residual"] = {"class_path": "nag", "init_args": {"theta_max": 0.25}}
    return {**saved, **arch, "_class_path": "nag_lightning.module.NAGLanguageModel"}


def debug_checkpoint(root: Path, residual_options: str) -> dict:
    """The checkpoint of two steps of the debug recipe with these residual options, trained in
    `root` on a text of the tests."""
    (root / "corpus.txt").write_text((Path(__file__).parent / "test_model.py").read_text() * 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        from nag_lightning.cli import main

        main(["fit", "--config", DEBUG, f"--data.source={root / 'corpus.txt'}", "--data.max_bytes=null",
              f"--data.cache_dir={root / 'cache'}", "--trainer.max_steps=2", "--model.arch.residual_options",
              residual_options, "--trainer.enable_progress_bar=false"])
    return torch.load(root / "runs/debug/version_0/checkpoints/last.ckpt", weights_only=True)


@pytest.fixture(scope="module")
def old_checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("old")
    checkpoint = debug_checkpoint(root, "{theta_max: 0.25}")
    checkpoint["hyper_parameters"] = flat_layout(checkpoint["hyper_parameters"])
    torch.save(checkpoint, root / "old.ckpt")
    return root / "old.ckpt"


def data_args(ckpt: Path) -> list[str]:
    root = ckpt.parent
    return [f"--data.source={root / 'corpus.txt'}", "--data.max_bytes=null",
            f"--data.cache_dir={root / 'cache'}"]


def test_the_old_layout_reads_as_the_new_one():
    old = {"d_model": 32, "lr": 0.01, "router": {"class_path": "topk", "init_args": {"capacity": 0.5}},
           "router_options": None, "route_kinds": None, "_instantiator": "x"}
    assert saved_model_settings(old) == {"lr": 0.01, "_instantiator": "x", "arch": {
        "d_model": 32, "router": "topk", "router_options": {"capacity": 0.5}}}
    new = {"arch": {"d_model": 32, "router": "topk"}, "lr": 0.01}
    assert saved_model_settings(new) == new
    # beside an `arch`, flat fields are not read: the model is built from `arch` alone
    assert saved_architecture({"arch": {"d_model": 32}, "d_model": 64}) == {"d_model": 32}


def test_an_old_checkpoint_loads_validates_resumes_sweeps_and_generates(old_checkpoint, tmp_path,
                                                                       capsysbinary, monkeypatch):
    from nag_lightning.checkpoints.loading import load_model
    from nag_lightning.training.module import LanguageModel

    module = LanguageModel.load_from_checkpoint(old_checkpoint)
    assert module.config.residual == "nag" and module.config.residual_options == {"theta_max": 0.25}
    assert module.config.d_model == 32 and module.config.route_kinds == ["attn", "mlp"]
    model = load_model(str(old_checkpoint)).model
    weights = torch.load(old_checkpoint, weights_only=True)["state_dict"]
    torch.testing.assert_close(model.head.weight, weights["model.head.weight"])
    monkeypatch.chdir(tmp_path)
    for command in (["validate", "--config", DEBUG, *data_args(old_checkpoint)],
                    ["fit", "--config", DEBUG, *data_args(old_checkpoint), "--trainer.max_steps=3",
                     "--model.arch.residual_options", "{theta_max: 0.25}"]):
        status, _, err = run_command([*command, f"--ckpt_path={old_checkpoint}"], capsysbinary)
        assert status == 0, err[-2000:]
    status, _, err = run_command(["fit", "--config", DEBUG, *data_args(old_checkpoint),
                                  "--trainer.max_steps=3", "--model.arch.d_model=64",
                                  f"--ckpt_path={old_checkpoint}"], capsysbinary)
    assert status == 1 and "different architecture: model.arch.d_model=32 (this run: 64)" in err
    sweeps_and_generates(old_checkpoint, tmp_path, capsysbinary)


def sweeps_and_generates(checkpoint: Path, out: Path, capsysbinary) -> None:
    """`sweep` (into `out`) and `generate` run on `checkpoint`, trained by `debug_checkpoint`."""
    own_data = [a.replace("--data.", "--") for a in data_args(checkpoint) if "max_bytes" not in a]
    status, text, err = run_command(["sweep", f"--ckpt_path={checkpoint}", "--val_batches=1", *own_data,
                                     "--fit_batches=1", "--taus=[0.0]", f"--out_dir={out / 's'}"],
                                    capsysbinary)
    assert status == 0 and "threshold tau=0" in text, err[-2000:]
    status, text, err = run_command(["generate", f"--ckpt_path={checkpoint}", "--max_new_tokens=2"],
                                    capsysbinary)
    assert status == 0 and "sublayers executed" in text, err[-2000:]


def test_a_class_path_saved_flat_by_an_old_checkpoint_still_needs_trust(old_checkpoint, tmp_path, capsys):
    checkpoint = torch.load(old_checkpoint, weights_only=True)
    checkpoint["hyper_parameters"]["router"] = "logging.basicConfig"
    torch.save(checkpoint, tmp_path / "doctored.ckpt")
    status, _, err = run_command(["generate", f"--ckpt_path={tmp_path / 'doctored.ckpt'}"], capsys)
    assert status == 1 and "model.arch.router='logging.basicConfig'" in err and "--trust_checkpoint" in err


def test_an_old_config_is_one_sentence_saying_how_to_map_it(tmp_path, capsys):
    old = tmp_path / "old.yaml"
    old.write_text("model:\n  d_model: 32\n  router: threshold\n  lr: 0.01\n")
    for args, named in ((["--config", str(old)], f"The config {old} sets model.d_model, model.router, but"),
                        (["--model.n_layers=2"], "The command line sets model.n_layers, but")):
        status, _, err = run_command(["fit", "--config", DEBUG, *args], capsys)
        lines = [line for line in err.splitlines() if line.startswith("nag-lightning: error:")]
        assert status == 1 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert named in lines[0] and "now live under model.arch" in lines[0]
        assert "model.arch.residual_options" in lines[0]


def test_rope_base_is_a_setting_of_the_architecture(tmp_path, capsys, monkeypatch):
    from nag_lightning.cli import run_lightning_cli

    monkeypatch.chdir(tmp_path)
    cli = run_lightning_cli(["--config", DEBUG, "--model.arch.rope_base=500"], run=False)
    assert cli.model.config.rope_base == 500
    angles = cli.model.model.rotary.cos.shape
    inv_freq = 500.0 ** (-torch.arange(0, angles[1] * 2, 2).float() / (angles[1] * 2))
    torch.testing.assert_close(cli.model.model.rotary.cos[1], inv_freq.cos())
