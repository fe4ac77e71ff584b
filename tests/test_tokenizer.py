"""data.tokenizer: bytes, a trained BPE and a tokenizer.json; their caches, bits per byte across
tokenizers, checkpoints that carry their tokenizer, generation, and bad input."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import socket
from pathlib import Path

import lightning as L
import pytest
import torch
from litdata import StreamingDataset, TokensLoader

from nag_lightning.cli import main
from nag_lightning.data import (
    TextDataModule,
    bpe_training,
    load_tokenizer,
    prepare_corpus,
    resolve_files,
    token_counts,
    tokenizing,
)
from nag_lightning.data import tokenizer as tokenizers
from nag_lightning.data.tokenizer import HFTokenizer, StreamDecoder, Tokenizer
from nag_lightning.model import TransformerConfig
from nag_lightning.training.module import LanguageModel
from tests.helpers import run_command as run_cli

ROOT = Path(__file__).resolve().parents[1]
DEBUG = str(ROOT / "recipes" / "debug.yaml")
SEQ = 16
# Python-like text with multi-byte characters, so BPE ids end inside UTF-8 characters too.
LINES = [
    "def f(x):\n    return x + 1\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "# café, naïve, Zürich — ünïcödé ✓ 中文\n",
    "for i in range(10):\n    print(i, 'value', i * 2)\n\n",
    "import os\nimport sys\n",
]

pytestmark = pytest.mark.usefixtures("one_thread")


def text(lines: int, seed: int) -> str:
    return "".join(LINES[(i * 7 + seed) % len(LINES)] for i in range(lines))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tok") / "corpus"
    folder.mkdir()
    for i in range(3):
        (folder / f"f{i}.py").write_text(text(120 + 40 * i, i), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def cache(corpus) -> Path:
    return corpus.parent / "cache"


def stream(split_dir: Path) -> list[int]:
    """All token ids of a prepared split, in order."""
    chunks = json.loads((split_dir / "index.json").read_text())["chunks"]
    dataset = StreamingDataset(str(split_dir), item_loader=TokensLoader(block_size=chunks[0]["dim"]))
    assert len(chunks) == 1
    return dataset[0].tolist()


def cut(content: bytes, val_fraction: float = 0.05) -> int:
    return len(content) - round(len(content) * val_fraction)


# ---- the BPE and its cache --------------------------------------------------------------------------


def test_bpe_chunks_are_the_tokens_of_each_file_and_decode_to_the_text(corpus, cache):
    root = prepare_corpus(str(corpus), cache, tokenizer="bpe:300")
    tok = load_tokenizer("bpe:300", str(corpus), cache)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 300 and tok.dtype == torch.int16
    files = sorted(corpus.iterdir())
    train = [f.read_bytes()[: cut(f.read_bytes())] for f in files]
    assert stream(root / "train") == [i for t in train for i in tok.encode(t).tolist()]
    assert tok.decode(stream(root / "train")) == b"".join(train)  # every id has definite bytes
    assert token_counts(root)["train"] < 0.7 * sum(map(len, train))  # merges happened
    meta = json.loads((root / "meta.json").read_text())
    assert meta["tokenizer"] == "bpe:300" and meta["vocab_size"] == 300
    assert meta["coverage"]["token_bytes"] == meta["coverage"]["bytes"]
    # the folder carries its tokenizer: it is a data.source by itself
    assert HFTokenizer((root / "tokenizer.json").read_text(), "x").key == tok.key
    assert TextDataModule(str(root), seq_len=SEQ).tokenizer == tok


def test_a_piece_cut_for_encoding_gives_the_ids_of_the_whole():
    tok = HFTokenizer(bpe_training.train_bpe([text(200, 0)], 320), "bpe:320")
    whole = text(400, 1).encode()
    pieces = tokenizers.split_text(whole, target=97)
    assert len(pieces) > 20 and b"".join(pieces) == whole
    assert tok.encode(whole).tolist() == tok.hf.encode(whole.decode(), add_special_tokens=False).ids
    # the 4 MiB reader cuts at the same places, carrying the rest over
    assert all(p.startswith(b"\n") for p in pieces[1:])


def test_caches_are_keyed_by_tokenizer_and_bytes_keep_their_key(corpus, cache, monkeypatch):
    source = str(corpus)
    as_bytes = prepare_corpus(source, cache)
    files = resolve_files(source)
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    old_key = hashlib.sha256(json.dumps([1, stats, 0.05, None]).encode()).hexdigest()[:16]
    assert as_bytes.name == old_key  # caches written before tokenizers existed stay valid
    bpe300 = prepare_corpus(source, cache, tokenizer="bpe:300")
    bpe400 = prepare_corpus(source, cache, tokenizer="bpe:400")
    assert len({as_bytes, bpe300, bpe400}) == 3
    assert sorted(p.name.split("-")[0] for p in (cache / "tokenizers").glob("*.json")) == [
        "bpe300", "bpe400"]

    def must_not_run(*args):
        raise AssertionError("trained or tokenized again")

    with monkeypatch.context() as patch:
        patch.setattr(tokenizing, "in_child", must_not_run)
        assert prepare_corpus(source, cache, tokenizer="bpe:300") == bpe300
        # the same tokenizer given as a tokenizer.json file shares the chunks
        as_file = cache.parent / "tokenizer.json"
        as_file.write_text((bpe300 / "tokenizer.json").read_text())
        assert prepare_corpus(source, cache, tokenizer=str(as_file)) == bpe300


def test_the_bpe_trains_on_the_training_split_only(tmp_path):
    (tmp_path / "a.txt").write_text("abcabc " * 200 + "zqzqzqzq " * 40)  # zq only in the last 25%
    tok = load_tokenizer("bpe:270", str(tmp_path / "a.txt"), tmp_path / "c", val_fraction=0.25)
    pieces = {b for b in tok.token_bytes}
    assert b"abc" in pieces and not any(b"zq" in p for p in pieces)


def test_bpe_training_reads_an_evenly_spread_sample():
    pieces = [(f"f{i}", 0, 100) for i in range(10)]
    assert bpe_training.sample_pieces(pieces, 10_000) == pieces
    assert bpe_training.sample_pieces(pieces, 300) == [("f0", 0, 100), ("f4", 0, 100), ("f8", 0, 100)]
    assert bpe_training.sample_pieces([("big", 0, 1000)], 300) == [("big", 0, 300)]


def test_the_bpe_round_trips_any_bytes_with_tokens_as_long_as_their_bytes():
    latin1 = text(120, 3).encode("latin-1", errors="replace") + bytes(range(256))
    noise = torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(0))
    noise = bytes(noise.tolist())
    from_bytes = HFTokenizer(bpe_training.train_bpe([latin1], 300), "bpe:300")
    from_text = HFTokenizer(bpe_training.train_bpe([text(100, 2)], 300), "bpe:300")
    for tok in (from_bytes, from_text):
        for raw in (latin1, noise, b"caf\xe9\n\xed\xb2\x80\xff", text(20, 1).encode()):
            ids = tok.encode(raw)
            assert tok.decode(ids.tolist()) == raw
            assert int(tok.byte_lengths[ids.long()].sum()) == len(raw)
    # trained on the Latin-1 bytes themselves, not on the UTF-8 of U+FFFD standing for them
    merged = [t for t in from_bytes.token_bytes if len(t) > 1]
    assert b"\xe9" in latin1 and not [t for t in merged if b"\xef\xbf" in t]


def test_bytes_train_the_same_merges_as_their_text_and_encode_to_the_same_ids():
    raw = text(150, 4).encode()
    from_text = bpe_training.train_bpe([raw.decode()], 320)
    assert bpe_training.train_bpe([raw], 320) == from_text
    tok = HFTokenizer(from_text, "bpe:320")
    words = tokenizers.byte_words(tok.hf.pre_tokenizer, raw)
    by_words = tok._by_words.encode(words, is_pretokenized=True, add_special_tokens=False).ids
    assert by_words == tok.encode(raw).tolist()


def test_a_tokenizer_that_is_not_byte_level_reads_stray_bytes_as_replacement_characters():
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    hf = HF(models.WordLevel({"caf": 0, "\ufffd": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.Split(pattern="caf", behavior="isolated")
    tok = HFTokenizer(hf.to_str(), "words")
    assert tok.encode(b"caf\xe9caf").tolist() == [0, 1, 0]


def test_prepare_on_a_latin1_corpus_reports_token_bytes_equal_to_its_bytes(tmp_path, recwarn):
    folder = tmp_path / "latin1"
    folder.mkdir()
    for i in range(2):
        (folder / f"f{i}.txt").write_bytes(text(150, i).encode("latin-1", errors="replace"))
    root = prepare_corpus(str(folder), tmp_path / "cache", tokenizer="bpe:300")
    coverage = json.loads((root / "meta.json").read_text())["coverage"]
    assert coverage["token_bytes"] == coverage["bytes"] > 1000
    assert not [w for w in recwarn if "stand for" in str(w.message)]
    tok = load_tokenizer("bpe:300", str(folder), tmp_path / "cache")
    train = [f.read_bytes()[: cut(f.read_bytes())] for f in sorted(folder.iterdir())]
    assert tok.decode(stream(root / "train")) == b"".join(train)


# ---- bits per byte ----------------------------------------------------------------------------------


class Uniform(LanguageModel):
    """A model whose every prediction is uniform over its vocabulary: loss ln V per token."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(TransformerConfig(vocab_size=vocab_size, d_model=16, n_layers=1, n_heads=2,
                                           seq_len=SEQ))
        torch.nn.init.zeros_(self.model.head.weight)


@pytest.mark.parametrize("spec", ["bytes", "bpe:300"])
def test_bits_per_byte_is_the_summed_loss_over_the_bytes_the_tokens_stand_for(spec, corpus, cache):
    dm = TextDataModule(str(corpus), seq_len=SEQ, batch_size=3, cache_dir=str(cache), tokenizer=spec)
    model = Uniform(vocab_size=dm.vocab_size)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False)
    [metrics] = trainer.validate(model, dm, verbose=False)
    targets = torch.cat([batch[:, 1:] for batch in dm.val_dataloader()])
    tokens = targets.numel()
    n_bytes = int(dm.tokenizer.byte_lengths[targets].sum())
    V = dm.vocab_size
    assert metrics["val/loss_per_token"] == pytest.approx(math.log(V), rel=1e-6)
    assert metrics["val/bpb"] == pytest.approx(tokens * math.log2(V) / n_bytes, rel=1e-6)
    if spec == "bytes":
        assert n_bytes == tokens and metrics["val/bpb"] == pytest.approx(8.0, rel=1e-6)
    else:
        assert n_bytes > 1.5 * tokens  # a BPE token stands for several bytes


def test_predict_gives_per_sequence_bits_per_byte(corpus, cache):
    dm = TextDataModule(str(corpus), seq_len=SEQ, batch_size=3, cache_dir=str(cache), tokenizer="bpe:300")
    model = Uniform(vocab_size=dm.vocab_size)
    model.set_tokenizer(dm.tokenizer)
    dm.setup("fit")
    batch = next(iter(dm.val_dataloader()))
    per_row = model.predict_step(batch, 0)
    n_bytes = dm.tokenizer.byte_lengths[batch[:, 1:]].sum(1)
    torch.testing.assert_close(per_row, SEQ * math.log2(300) / n_bytes.float())


# ---- the command line -------------------------------------------------------------------------------


def fit(corpus: Path, cache: Path, *extra: str) -> list[str]:
    return ["fit", "--config", DEBUG, f"--data.source={corpus}", f"--data.cache_dir={cache}",
            "--trainer.enable_progress_bar=false", "--trainer.max_steps=3",
            "--trainer.val_check_interval=3", *extra]


def test_fit_on_a_bpe_offline_then_generate_with_the_checkpoints_tokenizer(
    corpus, tmp_path, capsysbinary, monkeypatch  # generate writes bytes, as generated
):
    monkeypatch.chdir(tmp_path)

    def no_network(*args, **kwargs):
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    cache = tmp_path / "fresh_cache"  # a fresh machine: no BPE, no chunks
    status, _, err = run_cli(fit(corpus, cache, "--data.tokenizer=bpe:300"), capsysbinary)
    assert status == 0, err[-3000:]
    [ckpt] = tmp_path.rglob("last.ckpt")
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["arch"]["vocab_size"] == 300  # linked from the tokenizer
    assert saved["tokenizer"]["spec"] == "bpe:300"
    assert HFTokenizer(saved["tokenizer"]["json"], "x") == load_tokenizer("bpe:300", str(corpus), cache)
    metrics = next(tmp_path.rglob("metrics.csv")).read_text()
    assert "val/bpb" in metrics and "val/loss_per_token" in metrics and "train/bpb" in metrics

    status, out, err = run_cli(["generate", "--ckpt_path", str(ckpt), "--prompt", "café ",
                                "--max_new_tokens", "5", "--show_routing", "true"], capsysbinary)
    assert status == 0, err[-3000:]
    assert out.startswith("café ") and "per generated token" in out
    assert out.count(" sublayers\n") == 5

    # the post-training sweep reports bits per byte of the checkpoint's tokens too
    from nag_lightning.analysis.sweeps.sweep import sweep

    paths = sweep(str(ckpt), out_dir=str(tmp_path / "sweep"), taus=[0.0], val_batches=2,
                  fit_batches=2, source=str(corpus), cache_dir=str(cache))
    [row] = [r for r in csv.DictReader(open(paths["csv"])) if r["method"] == "threshold"]
    dm = TextDataModule(str(corpus), seq_len=32, batch_size=4, cache_dir=str(cache),
                        tokenizer="bpe:300")
    dm.setup("validate")
    targets = torch.cat([batch[:, 1:] for batch, _ in zip(dm.val_dataloader(), range(2))])
    bytes_per_token = float(dm.tokenizer.byte_lengths[targets].sum()) / targets.numel()
    assert float(row["bpb"]) == pytest.approx(float(row["val_loss"]) / math.log(2) / bytes_per_token)

    # resuming on other tokens is refused in one sentence
    status, _, err = run_cli(fit(corpus, cache, "--trainer.max_steps=4", f"--ckpt_path={ckpt}"), capsysbinary)
    assert status == 1
    assert "The checkpoint was trained on tokens of data.tokenizer='bpe:300' (300 ids), but this " \
           "run's data uses data.tokenizer='bytes'" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--data.tokenizer=bpe:300", "--model.arch.vocab_size=256"],
         r"model.arch.vocab_size=256 does not match the 300 token ids of data.tokenizer='bpe:300'; "
         r"leave model.arch.vocab_size out"),
        (["--data.tokenizer=bpe:100"], r"data.tokenizer='bpe:100' is not a BPE the data can train"),
        (["--data.tokenizer=bpe:lots"], r"write 'bpe:<vocab size>'"),
        (["--data.tokenizer=nowhere/tokenizer.json"],
         r"data.tokenizer='nowhere/tokenizer.json' is neither 'bytes', 'bpe:<vocab size>' nor an "
         r"existing tokenizer.json file"),
    ],
    ids=["vocab_size", "small_bpe", "bpe_not_a_number", "missing_file"],
)
def test_bad_tokenizer_settings_get_one_sentence(extra, message, corpus, cache, tmp_path, capsys,
                                                 monkeypatch):
    import re

    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(fit(corpus, cache, *extra), capsys)
    lines = [line for line in err.splitlines() if line.startswith("nag-lightning: error:")]
    assert status == 1 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert re.search(message, lines[0]), lines[0]


def test_a_vocabulary_size_that_matches_the_tokenizer_is_accepted_and_one_in_a_config_is_checked(
    corpus, cache, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    status, _, err = run_cli(fit(corpus, cache, "--data.tokenizer=bpe:300", "--model.arch.vocab_size=300",
                                 "--trainer.max_steps=1", "--trainer.limit_val_batches=0"), capsys)
    assert status == 0, err[-2000:]
    config = tmp_path / "old_run.yaml"  # e.g. the config.yaml of a run from before tokenizers
    config.write_text("model:\n  arch:\n    vocab_size: 256\n")
    status, _, err = run_cli(fit(corpus, cache, "--data.tokenizer=bpe:300", f"--config={config}"), capsys)
    assert status == 1 and "model.arch.vocab_size=256 does not match the 300 token ids" in err


def test_a_file_that_is_not_a_tokenizer_and_a_folder_of_other_tokens(corpus, cache, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        load_tokenizer(str(bad))
    root = prepare_corpus(str(corpus), cache)  # bytes
    with pytest.raises(ValueError, match=r"was tokenized with data.tokenizer='bytes' \(256 ids\), "
                                         r"not data.tokenizer='bpe:300'"):
        prepare_corpus(str(root), cache, tokenizer="bpe:300")


def test_prepare_takes_the_tokenizer(corpus, cache, capsys):
    main(["prepare", "--source", str(corpus), "--cache_dir", str(cache), "--tokenizer", "bpe:300"])
    printed = capsys.readouterr().out.strip()
    assert printed == f"prepared {prepare_corpus(str(corpus), cache, tokenizer='bpe:300')}"


# ---- tokenizers as objects ---------------------------------------------------------------------------


def test_streaming_decode_holds_back_unfinished_characters():
    tok = Tokenizer()
    decoder = StreamDecoder(tok)
    pieces = [decoder.push(b) for b in "é✓".encode()] + [decoder.flush()]
    assert pieces == ["", "é", "", "", "✓", ""]
    decoder = StreamDecoder(tok)
    assert [decoder.push(b) for b in b"a\xff"] + [decoder.flush()] == ["a", "\ufffd", ""]


def test_saved_tokenizers_load_and_checkpoints_without_one_are_bytes():
    bpe = HFTokenizer(bpe_training.train_bpe([text(100, 2)], 300), "bpe:300")
    assert tokenizers.load_saved(bpe.saved()) == bpe
    assert tokenizers.load_saved(Tokenizer().saved()) == Tokenizer()
    assert tokenizers.load_saved(None) == Tokenizer()
    with pytest.raises(ValueError, match="does not hold it"):
        tokenizers.load_saved({"spec": "bpe:300"})
    data = "ünïcödé ✓ 中文 def f(x):".encode()
    assert bpe.decode(bpe.encode(data).tolist()) == data
