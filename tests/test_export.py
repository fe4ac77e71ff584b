"""`nag-lightning export` and reading its folder: equal logits for every residual x router, the
commands that take a checkpoint take the folder, and a damaged folder is refused in one sentence."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nag_lightning import RESIDUALS, ROUTERS
from nag_lightning.checkpoints.export import CONFIG, TOKENIZER, WEIGHTS, export_checkpoint
from nag_lightning.checkpoints.loading import load_model
from nag_lightning.checkpoints.reader import read_saved
from nag_lightning.data.bpe_training import train_bpe
from nag_lightning.data.tokenizer import HFTokenizer
from nag_lightning.model import TransformerConfig
from nag_lightning.training.module import LanguageModel
from tests.helpers import run_cli, run_command

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(d_model=16, n_layers=2, n_heads=2, seq_len=16)


def tiny_module(residual: str = "nag", router: str = "none", seed: int = 0, **arch) -> LanguageModel:
    """A tiny module whose every weight is moved off its initial value, so a weight the export
    left out would show in the logits."""
    torch.manual_seed(seed)
    module = LanguageModel(TransformerConfig(**{**TINY, "residual": residual, "router": router, **arch}))
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return module


def save_like_fit(module: LanguageModel, path: Path, step: int = 3) -> Path:
    """The checkpoint `nag-lightning fit` writes for `module`, without training."""
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams),
                  "global_step": step, "epoch": 0, "pytorch-lightning_version": version("lightning")}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return path


def said_once(err: str, text: str) -> bool:
    """Whether the command ended with one error sentence, and it holds `text`."""
    errors = [line for line in err.splitlines() if line.startswith("nag-lightning: error:")]
    return len(errors) == 1 and text in errors[0] and "Traceback" not in err


def logits(saved, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return load_model(saved).model(idx).logits


@pytest.mark.parametrize("residual", RESIDUALS.names())
@pytest.mark.parametrize("router", ROUTERS.names())
def test_an_exported_folder_gives_the_logits_of_its_checkpoint(tmp_path, residual, router):
    ckpt = save_like_fit(tiny_module(residual, router), tmp_path / "last.ckpt")
    out = export_checkpoint(str(ckpt), str(tmp_path / "export"))
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG, TOKENIZER, WEIGHTS])
    config = json.loads((out / CONFIG).read_text())
    assert config["arch"]["residual"] == residual and config["arch"]["router"] == router
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    original, exported = read_saved(ckpt), read_saved(out)
    assert exported.exported and exported.global_step == 3
    assert torch.equal(logits(original, idx), logits(exported, idx))
    # the module too (validate, sweep): settings, tokenizer and weights through the one reader
    module = LanguageModel.from_saved(exported).eval()
    with torch.no_grad():
        assert torch.equal(module(idx), logits(original, idx))


def test_the_tokenizer_travels_as_a_tokenizer_json_other_tools_read(tmp_path):
    from tokenizers import Tokenizer as HF

    bpe = HFTokenizer(train_bpe(["def main(): return 1\n" * 50, "class A: pass\n" * 50], 300), "bpe:300")
    module = tiny_module(vocab_size=bpe.vocab_size)
    module.set_tokenizer(bpe)
    out = export_checkpoint(str(save_like_fit(module, tmp_path / "bpe.ckpt")), str(tmp_path / "bpe"))
    text = "def main(): pass\n"
    assert HF.from_file(str(out / TOKENIZER)).encode(text).ids == bpe.encode(text.encode()).tolist()
    assert read_saved(out).tokenizer == bpe  # the same ids for the same text

    out = export_checkpoint(str(save_like_fit(tiny_module(), tmp_path / "bytes.ckpt")), str(tmp_path / "b"))
    assert HF.from_file(str(out / TOKENIZER)).encode("añ\n").ids == list("añ\n".encode())
    assert read_saved(out).tokenizer.spec == "bytes"


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("exported")
    ckpt = save_like_fit(tiny_module("nag", "threshold"), root / "last.ckpt")
    return export_checkpoint(str(ckpt), str(root / "model"))


def damaged(folder: Path, tmp_path: Path, name: str, change) -> Path:
    """A copy of the exported `folder` whose file `name` went through `change(path)`."""
    copy = tmp_path / "damaged"
    copy.mkdir()
    for file in folder.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    change(copy / name)
    return copy


def edit_config(**changes):
    def change(path: Path) -> None:
        config = json.loads(path.read_text())
        for key, value in changes.items():
            target = config
            *parents, last = key.split("__")
            for parent in parents:
                target = target[parent]
            target[last] = value
        path.write_text(json.dumps(config))
    return change


def edit_weights(name: str, value):
    def change(path: Path) -> None:
        weights = load_file(str(path))
        weights[name] = value(weights[name])
        save_file(weights, str(path))
    return change


BAD = {
    "missing weights": (WEIGHTS, lambda p: p.unlink(), "holds no model.safetensors"),
    "missing config": (CONFIG, lambda p: p.unlink(), "holds no config.json"),
    "damaged JSON": (CONFIG, lambda p: p.write_text('{"format": "nag-lightning", '), "not valid JSON"),
    "not our JSON": (CONFIG, lambda p: p.write_text("[1, 2]"), "does not say format"),
    "arch not a mapping": (CONFIG, edit_config(arch=[1]), "arch is missing or not a mapping"),
    "truncated weights": (WEIGHTS, lambda p: p.write_bytes(p.read_bytes()[:100]),
                          "not a readable safetensors file"),
    "wrong shape": (WEIGHTS, edit_weights("head.weight", lambda w: w[:, :8].contiguous()),
                    "head.weight is [256, 8], the model's [256, 16]"),
    "integer weights": (WEIGHTS, edit_weights("head.weight", lambda w: w.to(torch.int64)),
                        "head.weight is torch.int64, the model's torch.float32"),
    "int8 weights": (WEIGHTS, edit_weights("head.weight", lambda w: w.to(torch.int8)),
                     "of dtype torch.int8"),
    "unknown plugin": (CONFIG, edit_config(arch__residual="evil.module.Strategy"),
                       "names code by class path"),
    "unknown name": (CONFIG, edit_config(arch__router="nosuch"), "nosuch"),
    "bytes that are not": (TOKENIZER, lambda p: p.write_text(p.read_text().replace('"a":97', '"a":98')),
                           "does not stand for bytes"),
    "damaged tokenizer": (TOKENIZER, lambda p: p.write_text('{"model": '), "not a tokenizer the"),
    "tokenizer too large": (CONFIG, edit_config(arch__vocab_size=100), "beyond the model's vocabulary"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_damaged_folder_is_refused_in_one_sentence(exported, tmp_path, capsys, case):
    name, change, expected = BAD[case]
    folder = damaged(exported, tmp_path, name, change)
    status, err = run_cli(["generate", "--ckpt_path", str(folder), "--prompt", "a",
                           "--max_new_tokens", "2"], capsys)
    assert status == 1, err
    assert said_once(err, expected), err


def test_export_refuses_a_folder_that_holds_files_and_keeps_them(exported, tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    status, err = run_cli(["export", "--ckpt_path", str(exported), "--out", str(tmp_path)], capsys)
    assert status == 1 and said_once(err, "already exists") and (tmp_path / "keep.txt").read_text() == "mine"
    status, out, _ = run_command(["export", "--ckpt_path", str(exported), "--out", str(tmp_path / "again")],
                                 capsys)
    assert status == 0 and (tmp_path / "again" / WEIGHTS).is_file()


DEBUG = Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml"
DEBUG_ARCH = dict(d_model=32, n_layers=2, n_heads=2, seq_len=32)


@pytest.fixture(scope="module")
def debug_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A checkpoint of the debug recipe's architecture (threshold routing) and its export."""
    root = tmp_path_factory.mktemp("debug")
    ckpt = save_like_fit(tiny_module("nag", "threshold", **DEBUG_ARCH), root / "last.ckpt")
    return ckpt, export_checkpoint(str(ckpt), str(root / "model"))


def val_bpb(out: str) -> float:
    """val/bpb in Lightning's table of metrics, plain or drawn by rich (which transformers installs)."""
    line = next(line for line in out.splitlines() if "val/bpb" in line)
    return float(line.replace("│", " ").split()[-1])


def test_validate_generate_and_sweep_take_the_folder_as_they_take_the_checkpoint(
        debug_pair, tmp_path, capsysbinary, monkeypatch):
    # capsysbinary: generate writes bytes, which need not be UTF-8
    monkeypatch.chdir(tmp_path)
    data = ["--data.cache_dir", str(tmp_path / "cache"), "--data.max_bytes", "100000",
            "--trainer.logger", "false", "--trainer.enable_progress_bar", "false"]
    results = {}
    for path in debug_pair:
        status, out, err = run_command(["validate", "--config", str(DEBUG), "--ckpt_path", str(path), *data],
                                       capsysbinary)
        assert status == 0, err
        status, text, err = run_command(["generate", "--ckpt_path", str(path), "--prompt", "def ",
                                         "--max_new_tokens", "12", "--stream", "false"], capsysbinary)
        assert status == 0, err
        sweep_dir = tmp_path / f"sweep-{path.name}"
        status, _, err = run_command(["sweep", "--ckpt_path", str(path), "--out_dir", str(sweep_dir),
                                      "--taus", "[0.1, 0.5]", "--val_batches", "1", "--fit_batches", "1",
                                      "--cache_dir", str(tmp_path / "cache"), "--max_bytes", "100000"],
                                     capsysbinary)
        assert status == 0, err
        results[path.name] = (val_bpb(out), text, (sweep_dir / "sweep.csv").read_text())
    assert results["model"] == results["last.ckpt"]


def test_fit_starts_from_the_folders_weights_and_refuses_to_resume_it(debug_pair, tmp_path, capsys,
                                                                      monkeypatch):
    from nag_lightning.cli import run_lightning_cli

    monkeypatch.chdir(tmp_path)
    ckpt, folder = debug_pair
    data = ["--data.cache_dir", str(tmp_path / "cache"), "--data.max_bytes", "100000"]
    args = ["fit", "--config", str(DEBUG), "--model.arch.router", "threshold", *data]
    cli = run_lightning_cli([*args[1:], "--model.init_weights", str(folder)], run=False)
    expected = read_saved(ckpt).model_weights
    for name, value in cli.model.model.state_dict().items():
        assert torch.equal(value, expected[name]) if torch.is_tensor(value) else value == expected[name], name
    assert "init_weights" not in cli.model.hparams  # checkpoints keep the weights, not the path

    status, err = run_cli([*args, "--model.init_weights", str(folder), "--trainer.max_steps", "2",
                           "--trainer.val_check_interval", "2"], capsys)
    assert status == 0, err
    status, err = run_cli([*args, "--ckpt_path", str(folder)], capsys)
    assert status == 1 and said_once(err, "--model.init_weights"), err
    status, err = run_cli([*args, "--model.init_weights", str(folder), "--model.arch.d_model", "64"], capsys)
    assert status == 1 and said_once(err, "model.arch.d_model=32 (this run: 64)"), err
    # the same 256 ids, but another tokenizer than the weights' bytes
    status, err = run_cli([*args, "--model.init_weights", str(folder), "--data.tokenizer",
                           str(folder / TOKENIZER), "--trainer.max_steps", "1"], capsys)
    assert status == 1 and said_once(err, "give data.tokenizer=bytes"), err


def test_a_checkpoint_that_names_initial_weights_does_not_make_the_module_read_them(debug_pair, tmp_path):
    ckpt, folder = debug_pair
    doctored = torch.load(ckpt, weights_only=True)
    doctored["hyper_parameters"]["init_weights"] = str(tmp_path / "elsewhere")
    torch.save(doctored, tmp_path / "doctored.ckpt")
    module = LanguageModel.from_saved(read_saved(tmp_path / "doctored.ckpt"))  # no read of elsewhere
    assert torch.equal(module.model.head.weight, read_saved(folder).model_weights["head.weight"])
