"""`nag_lightning.load` on a trained debug checkpoint and on its export: generation (whole and
streamed) as the `generate` command's, scores and depth maps that agree with plain forward passes,
the `depth-map` command, and bad paths refused in one sentence."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import nag_lightning
from nag_lightning.analysis.evaluation.generate import generate
from nag_lightning.checkpoints.export import export_checkpoint
from nag_lightning.checkpoints.loading import load_model
from nag_lightning.cli import main
from tests.helpers import fit_args, run_cli, run_command
from tests.test_export import said_once, save_like_fit, tiny_module

pytestmark = pytest.mark.usefixtures("one_thread")
ROUTED = ["--model.arch.router=threshold", "--model.arch.router_options={target_rate: 0.25, warmup_steps: 1}"]


@pytest.fixture(scope="module")
def trained(corpus, one_thread) -> tuple[Path, Path]:
    """A checkpoint of a short fit of the debug recipe under the threshold router, and its export."""
    cwd = os.getcwd()
    try:
        os.chdir(corpus.parent)
        main(fit_args(corpus, *ROUTED))
    finally:
        os.chdir(cwd)
    ckpt = corpus.parent / "runs" / "debug" / "version_0" / "checkpoints" / "last.ckpt"
    return ckpt, export_checkpoint(str(ckpt), str(corpus.parent / "export"))


@pytest.fixture(scope="module")
def models(trained):
    return [nag_lightning.load(path) for path in trained]


def test_a_checkpoint_and_its_export_load_as_one_model(models, trained):
    from_ckpt, from_export = models
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_ckpt.model(idx).logits, from_export.model(idx).logits)
    assert not from_ckpt.model.training and from_ckpt.task is None
    assert "router threshold" in repr(from_ckpt)
    text = from_ckpt.generate("def ", max_new_tokens=16)
    assert text == from_export.generate("def ", max_new_tokens=16)
    # the command's own generation, from the same file, continues alike
    assert text == generate(str(trained[0]), "def ", max_new_tokens=16).text


def test_streaming_yields_the_continuation_piece_by_piece(models):
    llm = models[0]
    pieces = list(llm.generate("class ", max_new_tokens=12, temperature=0.8, seed=3, stream=True))
    assert len(pieces) > 1  # a piece per token, but for bytes held back inside a character
    assert "".join(pieces) == llm.generate("class ", max_new_tokens=12, temperature=0.8, seed=3)
    full = llm.generate("class ", max_new_tokens=12)
    stop = next(c for c in full[1:] if c.isascii())  # a character of one byte: one token
    assert llm.generate("class ", 12, stop=stop) == full[: full.index(stop) + len(stop)]
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("")


def test_scores_are_the_cross_entropy_of_a_forward_pass(models):
    llm = models[0]
    text = "def class return self import"
    score = llm.score(text)[0]
    ids = torch.tensor(list(text.encode()))
    with torch.no_grad():
        expected = F.cross_entropy(llm.model(ids[None, :-1]).logits[0], ids[1:], reduction="none")
    assert math.isnan(score.loss[0]) and torch.allclose(score.loss[1:], expected, atol=1e-5)
    assert score.tokens == list(text)
    bpb = expected.sum().item() / math.log(2) / (len(text) - 1)
    assert score.bits_per_byte == pytest.approx(bpb, rel=1e-5)
    assert score.mean_loss == pytest.approx(expected.mean().item(), rel=1e-5)
    torch.testing.assert_close(score.bits_per_byte_per_token[1:], expected / math.log(2))


def test_a_text_longer_than_the_context_is_scored_in_windows(models):
    llm = models[0]
    seq_len = llm.model.cfg.seq_len
    text = "def main(args):\n    return self.value[index]\n" * 3  # well over two contexts
    long, head = llm.score([text, text[: seq_len + 1]])
    assert torch.isfinite(long.loss[1:]).all() and len(long.tokens) == len(text)
    torch.testing.assert_close(long.loss[: seq_len + 1], head.loss, equal_nan=True)
    ids = torch.tensor(list(text.encode()))
    with torch.no_grad():  # the last token: predicted from the seq_len tokens before it
        logits = llm.model(ids[None, -seq_len - 1:-1]).logits[0, -1]
    assert long.loss[-1].item() == pytest.approx(F.cross_entropy(logits, ids[-1]).item(), rel=1e-5)


def test_the_depth_map_holds_each_tokens_angle_bound_and_route(models):
    llm = models[0]
    prompt = "for x in self.value:"
    depth = llm.depth(prompt)
    T, S = len(prompt), 2 * llm.model.cfg.n_layers
    assert depth.tokens == list(prompt) and depth.sublayers == ["0.attn", "0.mlp", "1.attn", "1.mlp"]
    assert depth.angle.shape == depth.executed.shape == (T, S) and depth.bound.shape == (S,)
    assert (depth.angle[~depth.executed] == 0).all() and (depth.angle[depth.executed] > 0).all()
    assert torch.isfinite(depth.bound).all() and (depth.angle <= depth.bound + 1e-5).all()
    assert 0 < depth.mod_rate < 1  # the threshold router skips some, not all
    # the route of the last token is the one cached generation takes from it
    ran = generate(str(llm.loaded.source), prompt, max_new_tokens=1).executed[0]
    assert int(depth.executed[-1].sum()) == ran
    assert depth.table().splitlines()[1].startswith("'f'") and "-" in depth.table()


def test_a_residual_without_a_bound_maps_with_nan_bounds(tmp_path):
    ckpt = save_like_fit(tiny_module("prenorm", "topk"), tmp_path / "prenorm.ckpt")
    depth = nag_lightning.load(ckpt).depth("abc")
    assert depth.bound.isnan().all() and depth.angle.isfinite().all()


def test_depth_map_draws_a_png_for_a_checkpoint_and_an_export(trained, tmp_path, capsys):
    for path in trained:
        out = tmp_path / f"{path.name}.png"
        status, text, err = run_command(["depth-map", "--ckpt_path", str(path), "--text", "def main():",
                                         "--out", str(out)], capsys)
        assert status == 0, err
        assert f"wrote {out}" in text and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    status, err = run_cli(["depth-map", "--ckpt_path", str(trained[0]), "--text", "x" * 40,
                           "--out", str(tmp_path / "long.png")], capsys)
    assert status == 1 and said_once(err, "more than the model's context of 32"), err


BAD_FOLDERS = {
    "neither": ({"notes.txt": "mine"}, "neither a checkpoint nor an export"),
    "hugging face": ({"config.json": json.dumps({"model_type": "llama"})}, "Hugging Face model folder"),
}


@pytest.mark.parametrize("case", BAD_FOLDERS)
def test_a_folder_that_is_no_model_is_refused_in_one_sentence(tmp_path, capsys, case):
    files, expected = BAD_FOLDERS[case]
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    if case == "neither":  # nag_lightning.load reads a Hugging Face folder (tests/test_hf.py)
        with pytest.raises(ValueError, match=expected):
            nag_lightning.load(tmp_path)
    status, err = run_cli(["depth-map", "--ckpt_path", str(tmp_path), "--text", "a",
                           "--out", str(tmp_path / "map.png")], capsys)
    assert status == 1 and said_once(err, expected), err
    assert not (tmp_path / "map.png").exists()


def test_a_tokenizer_that_does_not_fit_the_model_is_refused_in_one_sentence(tmp_path, capsys):
    ckpt = save_like_fit(tiny_module(vocab_size=300), tmp_path / "wide.ckpt")  # saved with bytes
    with pytest.raises(ValueError, match="a model of 300 token ids but a tokenizer of 256"):
        load_model(ckpt)
    status, err = run_cli(["depth-map", "--ckpt_path", str(ckpt), "--text", "a"], capsys)
    assert status == 1 and said_once(err, "tokenizer of 256"), err


def test_the_sweep_reads_and_checks_its_checkpoint_once(trained, corpus, tmp_path, monkeypatch):
    from nag_lightning.analysis.sweeps.sweep import sweep
    from nag_lightning.checkpoints import reader

    calls: dict[str, int] = {}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(reader, "read_checkpoint", counted("read", reader.read_checkpoint))
    for method in ("check_plugins", "check_weights"):
        original = getattr(reader.SavedCheckpoint, method)
        monkeypatch.setattr(reader.SavedCheckpoint, method, counted(method, original))
    sweep(str(trained[0]), out_dir=str(tmp_path), taus=[0.1], val_batches=1, fit_batches=1, oracle=False,
          source=str(corpus), cache_dir=str(corpus.parent / "cache"))
    assert calls == {"read": 1, "check_plugins": 1, "check_weights": 1}
