"""TextDataModule and prepare_corpus: tokenization, split, cache, errors and mid-epoch resume."""

import json
import os
import random
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from litdata import StreamingDataset, TokensLoader

from nag_lightning import data
from nag_lightning.callbacks import RunCheckpoint
from nag_lightning.data import TextDataModule, prepare_corpus, token_counts, tokenizing

SEQ = 16  # seq_len in these tests: samples are 17 bytes


def write(path: Path, size: int, seed: int) -> bytes:
    """A file of `size` pseudo-random bytes 1..255 (no NUL, so folders count it as text)."""
    content = bytes(random.Random(seed).choices(range(1, 256), k=size))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return content


def stream(split_dir: Path) -> bytes:
    """All tokens of a prepared split, in order (the tiny test corpora fit one chunk)."""
    chunks = json.loads((split_dir / "index.json").read_text())["chunks"]
    assert len(chunks) == 1
    dataset = StreamingDataset(str(split_dir), item_loader=TokensLoader(block_size=chunks[0]["dim"]))
    return bytes(dataset[0].tolist())


def cut(content: bytes, val_fraction: float = 0.05) -> int:
    return len(content) - round(len(content) * val_fraction)


@pytest.fixture
def corpus(tmp_path: Path) -> dict[str, bytes]:
    """Three text files in a folder, in sorted order (one nested, one an index.json that is not
    litdata's), plus a hidden file and a binary file that are skipped."""
    files = {
        name: write(tmp_path / "corpus" / name, size, seed)
        for name, size, seed in [("a.txt", 3000, 1), ("index.json", 400, 2), ("sub/b.py", 1700, 3)]
    }
    (tmp_path / "corpus" / ".hidden").write_text("never read")
    (tmp_path / "corpus" / "image.bin").write_bytes(b"\x89PNG\0\0\0binary")
    return files


def test_batches_have_shape_dtype_and_reproduce_the_corpus(tmp_path, corpus):
    dm = TextDataModule(str(tmp_path / "corpus"), seq_len=SEQ, batch_size=4, cache_dir=tmp_path / "c")
    dm.prepare_data()
    dm.setup("fit")
    train = list(dm.train_dataloader())
    val = list(dm.val_dataloader())
    for batch in train + val:
        assert batch.dtype == torch.long and batch.shape[1] == SEQ + 1
        assert 0 <= batch.min() and batch.max() <= 255
    assert all(b.shape[0] == 4 for b in train[:-1])
    assert max(b.max() for b in train) > 127  # bytes stay unsigned

    # val is not shuffled: its blocks are the end of each file, in file order.
    val_text = b"".join(c[cut(c) :] for c in corpus.values())
    val_blocks = len(val_text) // (SEQ + 1)
    assert bytes(torch.cat(val).flatten().tolist()) == val_text[: val_blocks * (SEQ + 1)]

    # train is shuffled: the same blocks as the start of each file, each exactly once.
    train_text = b"".join(c[: cut(c)] for c in corpus.values())
    expected = [train_text[i : i + SEQ + 1] for i in range(0, len(train_text) - SEQ, SEQ + 1)]
    got = [bytes(row.tolist()) for row in torch.cat(train)]
    assert got != expected  # shuffled
    assert sorted(got) == sorted(expected)


def test_split_is_deterministic_disjoint_and_covers_every_file(tmp_path, corpus):
    first = prepare_corpus(str(tmp_path / "corpus"), tmp_path / "c1", val_fraction=0.1)
    second = prepare_corpus(str(tmp_path / "corpus"), tmp_path / "c2", val_fraction=0.1)
    for split in ("train", "val"):
        assert stream(first / split) == stream(second / split)
    # each file's first 90% is train and its last 10% validation, files in sorted order
    train, val = stream(first / "train"), stream(first / "val")
    assert train == b"".join(c[: cut(c, 0.1)] for c in corpus.values())
    assert val == b"".join(c[cut(c, 0.1) :] for c in corpus.values())
    assert token_counts(first) == {"train": len(train), "val": len(val)}
    assert len(train) + len(val) == sum(map(len, corpus.values()))


def test_a_single_file_and_a_glob_work(tmp_path, corpus):
    single = prepare_corpus(str(tmp_path / "corpus" / "a.txt"), tmp_path / "c")
    content = corpus["a.txt"]
    assert stream(single / "train") + stream(single / "val") == content
    globbed = prepare_corpus(str(tmp_path / "corpus" / "**" / "*.py"), tmp_path / "c")
    assert stream(globbed / "train") + stream(globbed / "val") != content
    assert token_counts(globbed)["train"] == cut(corpus["sub/b.py"])


def test_max_bytes_caps_the_corpus(tmp_path, corpus):
    root = prepare_corpus(str(tmp_path / "corpus"), tmp_path / "c", max_bytes=3500)
    # a.txt and index.json whole (3400 bytes), then the first 100 bytes of sub/b.py
    kept = [corpus["a.txt"], corpus["index.json"], corpus["sub/b.py"][:100]]
    assert stream(root / "train") == b"".join(c[: cut(c)] for c in kept)
    assert sum(token_counts(root).values()) == 3500


def test_the_cache_is_reused_and_a_changed_corpus_retokenizes(tmp_path, corpus, monkeypatch):
    source, cache = str(tmp_path / "corpus"), tmp_path / "c"
    first = prepare_corpus(source, cache)

    def must_not_run(*args):
        raise AssertionError("re-tokenized a corpus that is already cached")

    with monkeypatch.context() as patch:
        patch.setattr(tokenizing, "in_child", must_not_run)
        assert prepare_corpus(source, cache) == first
        # seq_len does not change the tokens, so it shares the cache
        dm = TextDataModule(source, seq_len=8, cache_dir=str(cache))
        dm.prepare_data()
        dm.setup("fit")
        with pytest.raises(AssertionError, match="re-tokenized"):
            prepare_corpus(source, cache, val_fraction=0.2)

    new = write(tmp_path / "corpus" / "a.txt", 2000, seed=9)
    changed = prepare_corpus(source, cache)
    assert changed != first and first.is_dir()
    assert stream(changed / "train").startswith(new[: cut(new)])

    # a folder holding the cache inside the corpus does not feed the cache back into the corpus
    inside = prepare_corpus(source, tmp_path / "corpus" / "cache")
    assert prepare_corpus(source, tmp_path / "corpus" / "cache") == inside


def test_an_interrupted_prepare_leaves_no_cache_that_looks_complete(tmp_path, corpus, monkeypatch):
    source, cache = str(tmp_path / "corpus"), tmp_path / "c"

    def crash(fn, splits, tmp):
        (tmp / "train").mkdir()
        (tmp / "train" / "index.json").write_text("{}")
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(tokenizing, "in_child", crash)
        with pytest.raises(KeyboardInterrupt):
            prepare_corpus(source, cache)
    assert [p.name for p in cache.iterdir()] == ["CACHEDIR.TAG"]
    root = prepare_corpus(source, cache)
    assert stream(root / "val") == b"".join(c[cut(c) :] for c in corpus.values())


def test_tokenizing_leaves_the_global_random_state_alone(tmp_path, corpus):
    torch.manual_seed(7)
    prepare_corpus(str(tmp_path / "corpus"), tmp_path / "c")
    after = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(after, torch.rand(3))


def test_an_already_prepared_folder_is_a_source(tmp_path, corpus):
    root = prepare_corpus(str(tmp_path / "corpus"), tmp_path / "c")
    dm = TextDataModule(str(root), seq_len=SEQ, batch_size=2, cache_dir=str(tmp_path / "other"))
    dm.prepare_data()
    dm.setup("fit")
    assert not (tmp_path / "other").exists()
    assert next(iter(dm.val_dataloader())).shape == (2, SEQ + 1)
    # the sequence check also applies to prepared folders, after the fact
    too_long = TextDataModule(str(root), seq_len=1000, cache_dir=str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"The val split of the corpus has 255 bytes, fewer than one"):
        too_long.setup("fit")


def test_object_store_uris_pass_through_unchanged(tmp_path):
    assert prepare_corpus("s3://bucket/corpus/", tmp_path / "c") == "s3://bucket/corpus"
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"seq_len": 1}, ValueError, "data.seq_len must be at least 2, got 1"),
        ({"batch_size": 0}, ValueError, "data.batch_size must be at least 1, got 0"),
        ({"val_fraction": 0.0}, ValueError, r"data.val_fraction must be between 0 and 1"),
        ({"val_fraction": 1.0}, ValueError, r"data.val_fraction must be between 0 and 1"),
        ({"num_workers": -1}, ValueError, "data.num_workers must be 0 or more"),
    ],
)
def test_bad_arguments_get_one_sentence(kwargs, error, message):
    with pytest.raises(error, match=message):
        TextDataModule(**kwargs)


def test_bad_sources_get_one_sentence(tmp_path):
    def setup(source, **kwargs):
        dm = TextDataModule(source, seq_len=SEQ, cache_dir=str(tmp_path / "c"), **kwargs)
        dm.prepare_data()
        dm.setup("fit")

    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match=r"'.*nope.txt' does not exist; give an existing"):
        setup(missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        setup([str(tmp_path), missing])  # one bad entry in a list
    with pytest.raises(FileNotFoundError, match=r"The glob '.*\*.md' in data.source matches no"):
        setup(str(tmp_path / "*.md"))

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("")
    with pytest.raises(ValueError, match=r"is empty \(1 files, 0 bytes\); give files that contain"):
        setup(str(tmp_path / "empty"))
    (tmp_path / "binary").mkdir()
    (tmp_path / "binary" / "x.bin").write_bytes(b"\0\1\2")
    with pytest.raises(ValueError, match=r"is empty \(0 files, 0 bytes\)"):
        setup(str(tmp_path / "binary"))

    write(tmp_path / "short.txt", 100, seed=4)  # 95 train bytes, 5 val bytes
    with pytest.raises(
        ValueError,
        match=r"The val split of the corpus has 5 bytes, fewer than one sequence of data.seq_len "
        r"\+ 1 = 17 bytes; lower data.seq_len or data.val_fraction, or give more text.",
    ):
        setup(str(tmp_path / "short.txt"))
    with pytest.raises(ValueError, match=r"The train split of the corpus has 10 bytes"):
        setup(str(tmp_path / "short.txt"), max_bytes=20, val_fraction=0.5)
    with pytest.raises(ValueError, match="data.max_bytes must be positive"):
        setup(str(tmp_path / "short.txt"), max_bytes=0)

    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "index.json").write_text('{"chunks": [], "config": {}}')
    with pytest.raises(ValueError, match="is one optimized litdata dataset, but data.source needs"):
        setup(str(tmp_path / "one"))
    assert not (tmp_path / "c").exists()  # nothing written for bad input


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_mid_epoch_from_its_state_dict(tmp_path, corpus, num_workers):
    def loader():
        dm = TextDataModule(
            str(tmp_path / "corpus"),
            seq_len=SEQ,
            batch_size=3,
            cache_dir=str(tmp_path / "c"),
            num_workers=num_workers,
        )
        dm.setup("fit")
        return dm.train_dataloader()

    uninterrupted = list(loader())
    interrupted = loader()
    batches = iter(interrupted)
    head = [next(batches) for _ in range(5)]
    state = interrupted.state_dict()
    del batches
    resumed = loader()
    resumed.load_state_dict(state)
    tail = list(resumed)
    assert len(head) + len(tail) == len(uninterrupted)
    for got, want in zip(head + tail, uninterrupted):
        assert torch.equal(got, want)
    # a second epoch reshuffles the same blocks
    again = loader()
    first, second = torch.cat(list(again)), torch.cat(list(again))
    assert not torch.equal(first, second)
    assert sorted(map(tuple, first.tolist())) == sorted(map(tuple, second.tolist()))


class _Recorder(L.LightningModule):
    """Records every training batch; a single weight so the optimizer has something to step."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.seen.append(batch.clone())
        return self.weight * batch.float().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_lightning_checkpoints_carry_the_loader_state(tmp_path, corpus):
    def fit(max_steps, ckpt_path=None):
        dm = TextDataModule(
            str(tmp_path / "corpus"), seq_len=SEQ, batch_size=3, cache_dir=str(tmp_path / "c")
        )
        model = _Recorder()
        trainer = L.Trainer(
            max_steps=max_steps,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        )
        trainer.fit(model, dm, ckpt_path=ckpt_path)
        return trainer, model.seen

    _, uninterrupted = fit(8)
    trainer, head = fit(3)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")
    state = torch.load(tmp_path / "mid.ckpt", weights_only=False)
    [loader_state] = state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state["num_samples_yielded"] == 3 * 3
    _, tail = fit(8, ckpt_path=tmp_path / "mid.ckpt")
    assert len(head) == 3 and len(tail) == 5
    for got, want in zip(head + tail, uninterrupted):
        assert torch.equal(got, want)


def test_the_default_corpus_is_this_pythons_standard_library(tmp_path):
    files = data.stdlib_files()
    assert Path(os.__file__).resolve() in {f.resolve() for f in files}
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    assert not any({"site-packages", "dist-packages"} & set(f.parts) for f in files)
    assert data.resolve_files(None) == files
    # capped, as a quick recipe would; the full default takes about a second
    root = prepare_corpus(None, tmp_path / "c", max_bytes=50_000)
    assert sum(token_counts(root).values()) == 50_000
    first = files[0].read_bytes()
    assert stream(root / "train").startswith(first[: cut(first)])


@pytest.mark.parametrize("resume_at", ["mid_epoch", "epoch_end"])
def test_a_resumed_fit_matches_an_uninterrupted_one_across_epoch_boundaries(tmp_path, corpus, resume_at):
    """Every epoch reshuffles; a resumed run must reshuffle exactly as an uninterrupted one does,
    also after the epoch it resumed in (Lightning stops a sized loader at its length, which used
    to leave litdata replaying the resumed state in every later epoch)."""

    def fit(max_steps, ckpt_path=None):
        dm = TextDataModule(
            str(tmp_path / "corpus"), seq_len=SEQ, batch_size=16, cache_dir=str(tmp_path / "c")
        )
        model = _Recorder()
        # The CLI's checkpoint callback saves the last step at its batch end, as a run killed
        # right after it would have it.
        last = RunCheckpoint(dirpath=tmp_path / "ckpt", monitor=None, save_top_k=0, save_last=True)
        trainer = L.Trainer(
            max_steps=max_steps, limit_val_batches=0, logger=False, callbacks=[last],
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        )
        trainer.fit(model, dm, ckpt_path=ckpt_path)
        return trainer, model.seen

    trainer, uninterrupted = fit(50)
    epoch = trainer.num_training_batches
    assert 50 > 2 * epoch  # two epoch boundaries after the resume point
    stop = 5 if resume_at == "mid_epoch" else epoch
    shutil.rmtree(tmp_path / "ckpt")
    _, head = fit(stop)
    _, tail = fit(50, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert len(head) + len(tail) == len(uninterrupted)
    for step, (got, want) in enumerate(zip(head + tail, uninterrupted)):
        assert torch.equal(got, want), f"batch of step {step} differs (epoch is {epoch} steps)"
    # and the epochs really were reshuffled
    assert not torch.equal(uninterrupted[0], uninterrupted[epoch])


@pytest.mark.parametrize("old", ["nag_lightning.data.ByteDataModule", "nag_lightning.ByteDataModule"])
def test_configs_naming_the_data_module_by_its_earlier_name_still_load(tmp_path, monkeypatch, old):
    """Earlier configs and checkpoints name the text data module ByteDataModule."""
    from nag_lightning.cli import run_lightning_cli

    monkeypatch.chdir(tmp_path)
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "debug.yaml"
    data = json.dumps({"class_path": old, "init_args": {"source": "corpus.txt", "seq_len": 8}})
    cli = run_lightning_cli(["--config", str(recipe), f"--data={data}",
                             f"--trainer.default_root_dir={tmp_path}"], run=False)
    assert type(cli.datamodule) is TextDataModule and cli.datamodule.source == "corpus.txt"
