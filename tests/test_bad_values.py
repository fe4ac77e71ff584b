"""Bad input, third round: sizes a machine cannot hold, non-finite weights and impossible saved
settings, output folders under a file, overlong echoed values and task-file lines. Every case ends
within seconds with one sentence and exit status 1, and writes nothing; the checkpoints are real
ones of the debug recipe, changed as a hostile user would."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import pytest
import torch

from nag_lightning.cli import main
from nag_lightning.inputs import shorten, shorten_message
from nag_lightning.model import TransformerConfig
from nag_lightning.model.limits import MAX_LAYERS, check_size
from nag_lightning.tasks.datamodule import read_labelled
from tests.helpers import DEBUG, fit_args, run_cli
from tests.test_bad_input import one_sentence

pytestmark = pytest.mark.usefixtures("one_thread")
TASKS = str(Path(DEBUG).parent / "tasks" / "debug.yaml")
SECONDS = 60  # "within seconds" on a loaded two-core machine, with margin: the hang it replaces ran on


@pytest.fixture(scope="module")
def trained(corpus) -> Path:
    """A real checkpoint of two steps of the debug recipe."""
    cwd = os.getcwd()
    os.chdir(corpus.parent)
    try:
        main(fit_args(corpus, "--trainer.max_steps=2"))
    finally:
        os.chdir(cwd)
    return next(corpus.parent.rglob("last.ckpt"))


@pytest.fixture(scope="module")
def raw(trained) -> dict:
    return torch.load(trained, map_location="cpu", weights_only=True)


def changed(raw: dict, out: Path, change) -> Path:
    """A copy of the checkpoint `raw` with `change(copy)` applied, saved at `out`."""
    crafted = copy.deepcopy(raw)
    change(crafted)
    torch.save(crafted, out)
    return out


def command(name: str, ckpt: Path | str, corpus: Path, out: Path) -> list[str]:
    """`name` run on `ckpt`, writing (if at all) under `out`."""
    data = [f"--data.source={corpus}", f"--data.cache_dir={corpus.parent / 'cache'}"]
    return {
        "generate": ["generate", f"--ckpt_path={ckpt}", "--max_new_tokens=2"],
        "sweep": ["sweep", f"--ckpt_path={ckpt}", f"--out_dir={out / 'sweep'}", f"--source={corpus}",
                  f"--cache_dir={corpus.parent / 'cache'}", "--val_batches=1", "--fit_batches=1"],
        "validate": ["validate", "--config", DEBUG, *data, f"--ckpt_path={ckpt}",
                     "--trainer.enable_progress_bar=false"],
        "export": ["export", f"--ckpt_path={ckpt}", f"--out={out / 'export'}"],
        "fit": fit_args(corpus, f"--ckpt_path={ckpt}"),
    }[name]


def refused(args: list[str], capsys, tmp_path: Path) -> str:
    """The one sentence of a command that must fail fast and write nothing into `tmp_path` (its
    working directory)."""
    before = sorted(tmp_path.rglob("*"))
    start = time.monotonic()
    sentence = one_sentence(*run_cli(args, capsys))
    assert time.monotonic() - start < SECONDS
    assert sorted(tmp_path.rglob("*")) == before, "the refused command wrote files"
    return sentence


COMMANDS = ["generate", "sweep", "validate", "export"]


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize(("setting", "value", "expected"), [
    ("n_layers", 10_000_000, f"model.arch.n_layers=10,000,000 is more blocks than a model here may have "
                             f"({MAX_LAYERS:,})"),
    ("d_model", 1_000_000_000, "model.arch.d_model=1,000,000,000 makes a model that needs at least"),
])
def test_sizes_in_a_checkpoint_are_checked_before_anything_is_built(name, setting, value, expected, raw,
                                                                   corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = changed(raw, tmp_path / "big.ckpt",
                   lambda c: c["hyper_parameters"]["arch"].update({setting: value}))
    sentence = refused(command(name, ckpt, corpus, tmp_path), capsys, tmp_path)
    assert f"The checkpoint {ckpt} describes a model this machine cannot hold: {expected}" in sentence
    assert "; give a checkpoint of a model of at most" in sentence or (
        "bytes of memory this machine has; give a checkpoint of a smaller model" in sentence)


@pytest.mark.parametrize("option", ["--model.arch.seq_len=1000000000", "--model.arch.d_model=1000000000"])
def test_sizes_on_the_command_line_are_checked_before_the_data(option, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path / "cache"
    args = ["fit", "--config", DEBUG, f"--data.source={corpus}", f"--data.cache_dir={cache}",
            "--trainer.enable_progress_bar=false", option]
    sentence = refused(args, capsys, tmp_path)
    name = option.split("=")[0][len("--"):]
    assert f"{name}=1,000,000,000 makes a model that needs at least" in sentence
    assert f"give a smaller {name}" in sentence


def test_sizes_in_an_exported_folder_are_checked(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli(["export", f"--ckpt_path={trained}", "--out=folder"], capsys)[0] == 0
    config = json.loads(Path("folder/config.json").read_text())
    config["arch"]["d_model"] = 1_000_000_000
    Path("folder/config.json").write_text(json.dumps(config))
    sentence = refused(["generate", "--ckpt_path=folder", "--max_new_tokens=2"], capsys, tmp_path)
    assert "model.arch.d_model=1,000,000,000 makes a model that needs at least" in sentence


def test_the_size_check_names_the_setting_the_bytes_and_the_limit():
    debug = TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=32)
    check_size(debug, memory=2**30)  # the debug model fits a gigabyte
    with pytest.raises(ValueError, match=r"model.arch.seq_len=1,000,000 makes a model that needs at least "
                                         r"[\d,]+ bytes .* more than the 1,073,741,824 bytes of memory"):
        check_size(TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=1_000_000), memory=2**30)
    with pytest.raises(ValueError, match="model.arch.vocab_size=100,000,000 makes a model"):
        check_size(TransformerConfig(vocab_size=100_000_000, d_model=32, n_heads=2), memory=2**30)
    with pytest.raises(ValueError, match="model.arch.d_model must be a whole number; got 32.0"):
        TransformerConfig(d_model=32.0)
    with pytest.raises(ValueError, match="model.arch.mlp_ratio must be a finite positive number; got inf"):
        TransformerConfig(mlp_ratio=float("inf"))
    with pytest.raises(ValueError, match=f"give at most {MAX_LAYERS:,}"):
        TransformerConfig(n_layers=MAX_LAYERS + 1)


@pytest.mark.parametrize("name", COMMANDS)
def test_non_finite_weights_are_refused_naming_the_tensor(name, raw, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def poison(c: dict) -> None:
        for value in c["state_dict"].values():
            if torch.is_tensor(value) and value.is_floating_point():
                value.fill_(float("nan"))

    ckpt = changed(raw, tmp_path / "nan.ckpt", poison)
    sentence = refused(command(name, ckpt, corpus, tmp_path), capsys, tmp_path)
    assert "holds a weight model.embed.weight that is not finite (NaN or infinite)" in sentence


def test_one_infinite_weight_is_named(raw, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = changed(raw, tmp_path / "inf.ckpt",
                   lambda c: c["state_dict"]["model.head.weight"].view(-1).__setitem__(7, float("inf")))
    sentence = refused(["generate", f"--ckpt_path={ckpt}"], capsys, tmp_path)
    assert "holds a weight model.head.weight that is not finite" in sentence


@pytest.mark.parametrize("name", ["generate", "validate", "sweep"])
@pytest.mark.parametrize(("part", "setting", "expected"), [
    ("bound.", {"theta_max": 1e30}, "theta_max must be in (0, pi] radians; got 1e+30"),
    ("", {"bound": "cubic"}, "bound must be one of ('decaying', 'flat', 'learned'); got 'cubic'"),
    ("angle.", {"gate_radial": "yes"}, "gate_radial must be true or false; got 'yes'"),
])
def test_impossible_saved_settings_are_refused(name, part, setting, expected, raw, corpus, tmp_path, capsys,
                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    key = f"strategy.{part}_extra_state"
    ckpt = changed(raw, tmp_path / "settings.ckpt", lambda c: c["state_dict"][f"model.{key}"].update(setting))
    sentence = refused(command(name, ckpt, corpus, tmp_path), capsys, tmp_path)
    assert f"holds saved settings {key} that its model refuses" in sentence
    assert expected in sentence


def test_impossible_saved_settings_in_an_exported_folder_are_refused(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli(["export", f"--ckpt_path={trained}", "--out=folder"], capsys)[0] == 0
    config = json.loads(Path("folder/config.json").read_text())
    config["extra_state"]["strategy.bound._extra_state"]["theta_max"] = 1e30
    Path("folder/config.json").write_text(json.dumps(config))
    sentence = refused(["generate", "--ckpt_path=folder"], capsys, tmp_path)
    assert "theta_max must be in (0, pi] radians; got 1e+30" in sentence


@pytest.mark.parametrize("name", ["fit", "export", "sweep"])
def test_an_output_folder_under_a_file(name, trained, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("kept")
    args = {
        "fit": fit_args(corpus, f"--trainer.logger.init_args.save_dir={a_file / 'sub'}"),
        "export": ["export", f"--ckpt_path={trained}", f"--out={a_file / 'sub'}"],
        "sweep": ["sweep", f"--ckpt_path={trained}", f"--out_dir={a_file / 'sub'}", f"--source={corpus}",
                  f"--cache_dir={corpus.parent / 'cache'}", "--val_batches=1", "--fit_batches=1"],
    }[name]
    option = {"fit": "trainer.logger save_dir", "export": "--out", "sweep": "--out_dir"}[name]
    sentence = refused(args, capsys, tmp_path)
    assert f"{option} {a_file / 'sub'} lies under {a_file}, which is a file, not a folder" in sentence
    assert a_file.read_text() == "kept"


def test_an_output_folder_that_cannot_be_written(trained, tmp_path, capsys, monkeypatch):
    # Tests run as root, whom file modes do not stop: the permission check is what refuses.
    monkeypatch.chdir(tmp_path)
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access

    def refuse(path, *args, **kwargs) -> bool:
        return Path(path) != locked and access(path, *args, **kwargs)

    monkeypatch.setattr(os, "access", refuse)
    sentence = refused(["export", f"--ckpt_path={trained}", f"--out={locked / 'sub'}"], capsys, tmp_path)
    assert f"--out {locked / 'sub'} cannot be written ({locked} is not writable)" in sentence


def test_a_long_tokenizer_name_is_cut(raw, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = changed(raw, tmp_path / "name.ckpt", lambda c: c.update(tokenizer={"spec": "x" * 5_000_000}))
    status, err = run_cli(["generate", f"--ckpt_path={ckpt}"], capsys)
    sentence = one_sentence(status, err)
    assert len(err) < 1000
    assert "names the tokenizer 'xxx" in sentence
    assert "... (5,000,002 characters) but does not hold it" in sentence


def test_echoed_values_and_whole_messages_are_cut():
    assert shorten("short") == "short"
    assert shorten("y" * 1000, 10) == "yyyyyyyyyy... (1,000 characters)"
    message = "What is wrong: " + "z" * 10_000 + "\nhow to fix it."
    cut = shorten_message(message, 100)
    assert cut.startswith("What is wrong: ") and cut.endswith("how to fix it.") and "\n" not in cut
    assert "characters ...]" in cut and len(cut) < 200


def test_an_unknown_lightning_version(raw, corpus, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = changed(raw, tmp_path / "old.ckpt", lambda c: c.update({"pytorch-lightning_version": "0.0.1"}))
    sentence = refused(command("fit", ckpt, corpus, tmp_path), capsys, tmp_path)
    assert "says Lightning '0.0.1' wrote it" in sentence


def test_a_config_json_nested_too_deeply(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_cli(["export", f"--ckpt_path={trained}", "--out=folder"], capsys)[0] == 0
    text = Path("folder/config.json").read_text()
    Path("folder/config.json").write_text(text.replace('"data": {', '"data": {"x": ' + "[" * 200_000
                                                       + "]" * 200_000 + ", ", 1))
    sentence = refused(["generate", "--ckpt_path=folder"], capsys, tmp_path)
    assert "The config.json of folder is not valid JSON (maximum recursion depth" in sentence


TASK_LINE = b'{"tokens": [1, 2], "difficulty": [0, 0]}\n'


@pytest.mark.parametrize(("line", "expected"), [
    (b'{"text": "a\xff", "difficulty": [0, 0]}\n', "line 2 is not UTF-8 (byte 12 of the line)"),
    (b'{"tokens": [1, 2], "difficulty": [0, 1' + b"0" * 30 + b"]}\n",
     "line 2 has a difficulty label above 2,147,483,647"),
    (b'{"tokens": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "line 2 is not JSON (nested too deeply)"),
], ids=["not_utf8", "label_1e30", "nested"])
def test_every_task_file_error_names_its_line(line, expected, tmp_path, capsys, monkeypatch):
    file = tmp_path / "lines.jsonl"
    file.write_bytes(TASK_LINE + line)
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        read_labelled(file, 8)
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", TASKS, f"--data.file={file}", "--data.val_sequences=1",
            "--trainer.enable_progress_bar=false"]
    assert expected in refused(args, capsys, tmp_path)
