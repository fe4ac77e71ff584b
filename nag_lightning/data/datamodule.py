"""`TextDataModule`: a tokenized corpus streamed in blocks of `seq_len + 1` tokens by litdata,
sharded across ranks and workers and resumable mid-epoch."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from litdata import StreamingDataLoader, StreamingDataset, TokensLoader

from nag_lightning.data import tokenizer as tokenizers
from nag_lightning.data.bpe import load_tokenizer
from nag_lightning.data.corpus import check_fraction, check_source, split_chunks, too_short
from nag_lightning.data.filesystem import is_remote, unreachable
from nag_lightning.data.prepare import prepare_corpus
from nag_lightning.data.tokenizer import Tokenizer

# Newer litdata shuffles items within a chunk only inside windows of 256 blocks unless told to
# permute the whole chunk; older releases always permuted the whole chunk.
_FULL_SHUFFLE = (
    {"item_shuffle_window": 0}
    if "item_shuffle_window" in inspect.signature(StreamingDataset).parameters
    else {}
)


class _EpochExactLoader(StreamingDataLoader):
    """A StreamingDataLoader whose resumed epoch ends where an uninterrupted one would.

    litdata replays a loaded state on the next `__iter__` and clears its `restore` flag only when
    that iteration runs to its end. Lightning stops reading a loader with a length after exactly
    `len(loader)` batches, so after a mid-epoch resume the flag stayed set: the next epoch skipped
    litdata's per-epoch reset, replayed the old state and reused the old shuffle, and training
    diverged from an uninterrupted run at the first epoch boundary. Only the first iteration after
    `load_state_dict` may replay the state.
    """

    _replay_pending = False

    def load_state_dict(self, obj: dict[str, Any]) -> None:
        # A checkpoint's loader state is untrusted input, and litdata indexes into it as it comes,
        # here and again when the first epoch replays it: check what it reads unconditionally.
        try:
            problem = _loader_state_problem(obj)
            if problem:
                raise ValueError(problem)
            super().load_state_dict(obj)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            reason = f"{type(error).__name__}: {str(error)[:160]}"
            raise ValueError(
                f"The checkpoint's data loader state does not fit this data ({reason}); resume with "
                "the data settings the run was trained with (its config.yaml), or give an "
                "undamaged checkpoint written by `nag-lightning fit`."
            ) from None
        self._replay_pending = self.restore

    def __iter__(self) -> Iterator[Any]:
        if not self._replay_pending:
            self.restore = False  # the epoch that replayed the state is over
        self._replay_pending = False
        yield from super().__iter__()


_LOADER_COUNTS = ("current_epoch", "num_samples_yielded")
_DATASET_COUNTS = ("current_epoch", "num_samples_yielded", "num_workers", "batch_size", "seed")


def _loader_state_problem(state: object) -> str | None:
    """What a saved StreamingDataLoader state lacks of what litdata reads from it, if anything."""
    if not isinstance(state, dict) or not isinstance(state.get("dataset"), dict):
        return "not a mapping with a dataset state"
    for where, values, keys in (("", state, _LOADER_COUNTS), ("dataset.", state["dataset"], _DATASET_COUNTS)):
        for key in keys:
            value = values.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return f"{where}{key}={value!r} is not a count"
    if not isinstance(state["dataset"].get("shuffle"), bool):
        return "dataset.shuffle is not true or false"
    return None


def _collate(blocks: list[torch.Tensor]) -> torch.Tensor:
    """Stack blocks of token ids into the LongTensor (batch, seq_len + 1) the model embeds."""
    return torch.stack(blocks).long()


class TextDataModule(L.LightningDataModule):
    """Text tokenized once into litdata chunks and streamed in blocks: bytes (vocab 256) by default,
    or the tokenizer `tokenizer` names.

    Batches are LongTensors (batch_size, seq_len + 1) of token ids 0..vocab_size - 1.
    """

    def __init__(
        self,
        source: str | list[str] | None = None,
        seq_len: int = 256,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        cache_dir: str = "data_cache",
        num_workers: int = 0,
        seed: int = 42,
        max_bytes: int | None = None,
        tokenizer: str = tokenizers.BYTES,
    ) -> None:
        """
        Args:
            source: Text to train on: a file, a directory (all text files under it), a glob, or a
                list of these; or a folder with train/ and val/ already optimized by litdata, or an
                object-store URI (s3://...) holding them. None: this Python's standard library.
            seq_len: Tokens of context per sample; each sample has seq_len + 1 tokens.
            batch_size: Samples per batch on each device.
            val_fraction: Fraction of every file, taken from its end, held out for validation.
            cache_dir: Folder for the tokenized corpus; one subfolder per distinct corpus.
            num_workers: DataLoader worker processes per device (0: load in the main process).
            seed: Seed of the training shuffle (reshuffled every epoch).
            max_bytes: Use at most this many bytes of the corpus, files in sorted order; None: all
                of it (the standard library is capped at 64 MiB).
            tokenizer: "bytes" (one token per byte, vocab 256); "bpe:<vocab size>", a byte-level
                BPE trained here on the training split (at most 64 MiB of it, evenly spaced files)
                and cached under cache_dir/tokenizers; or the path of a Hugging Face tokenizer.json.
                model.arch.vocab_size follows it.
        """
        super().__init__()
        check_source(source)
        if seq_len < 2:
            raise ValueError(f"data.seq_len must be at least 2, got {seq_len}.")
        if batch_size < 1:
            raise ValueError(f"data.batch_size must be at least 1, got {batch_size}.")
        if num_workers < 0:
            raise ValueError(f"data.num_workers must be 0 or more, got {num_workers}.")
        check_fraction(val_fraction)
        self.save_hyperparameters()
        self.source, self.seq_len, self.batch_size = source, seq_len, batch_size
        self.val_fraction, self.cache_dir, self.max_bytes = val_fraction, cache_dir, max_bytes
        self.num_workers, self.seed = num_workers, seed
        tokenizers.parse_spec(tokenizer)  # a malformed spec is refused before anything is read
        self.tokenizer_spec = tokenizer
        self._tokenizer: Tokenizer | None = None
        self.train_set: StreamingDataset | None = None
        self.val_set: StreamingDataset | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer of the data; a BPE is trained here the first time it is asked for (the
        command line asks at once, to size the model's vocabulary)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(
                self.tokenizer_spec, self.source, self.cache_dir, self.val_fraction, self.max_bytes
            )
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of token ids of the tokenizer: 256 for bytes."""
        return self.tokenizer.vocab_size

    def _prepare(self) -> Path | str:
        return prepare_corpus(self.source, self.cache_dir, self.val_fraction, self.max_bytes,
                              self.seq_len, self.tokenizer_spec)

    def prepare_data(self) -> None:
        """Tokenize the corpus (once per node: Lightning calls this on local rank 0 only)."""
        self._prepare()

    def setup(self, stage: str | None = None) -> None:
        """Open the prepared splits as streaming datasets (on every rank, after `prepare_data`)."""
        # A complete cache is found by its hash, so this only re-tokenizes if `prepare_data` did not
        # run on this machine (e.g. `prepare_data_per_node=False` without a shared file system).
        root = self._prepare()
        self.train_set = self._dataset(root, "train", shuffle=True)
        self.val_set = self._dataset(root, "val", shuffle=False)

    def _dataset(self, root: str | Path, split: str, shuffle: bool) -> StreamingDataset:
        block = self.seq_len + 1  # inputs [:, :-1], targets [:, 1:]
        remote_cache = None
        if is_remote(str(root)):  # downloaded chunks go under cache_dir, not ~/.lightning/chunks
            key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
            remote_cache = str(Path(self.cache_dir).expanduser().resolve() / "remote" / key / split)
        else:
            chunks = split_chunks(Path(root, split))
            if sum(c["dim"] // block for c in chunks) == 0:  # blocks never straddle two chunks
                unit = "bytes" if self.tokenizer.key == tokenizers.BYTES else "tokens"
                raise too_short(split, sum(c["dim"] for c in chunks), block, unit)
        try:
            return StreamingDataset(
                f"{root}/{split}",
                cache_dir=remote_cache,
                item_loader=TokensLoader(block_size=block),
                shuffle=shuffle,
                seed=self.seed,
                **_FULL_SHUFFLE,
            )
        except Exception as error:
            if remote_cache is None:
                raise
            raise unreachable(str(root), error) from None

    def _loader(self, dataset: StreamingDataset | None) -> StreamingDataLoader:
        if dataset is None:
            raise RuntimeError("Call TextDataModule.setup() before asking for a dataloader.")
        return _EpochExactLoader(
            dataset,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            collate_fn=_collate,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> StreamingDataLoader:
        """Shuffled blocks, reshuffled each epoch; sharded over ranks and workers, resumable."""
        return self._loader(self.train_set)

    def val_dataloader(self) -> StreamingDataLoader:
        """The held-out end of every file, in corpus order."""
        return self._loader(self.val_set)

    def test_dataloader(self) -> StreamingDataLoader:
        """There is no third split: `test` reports on the validation bytes."""
        return self._loader(self.val_set)


# The name of earlier releases: configs and checkpoints that name nag_lightning.data.ByteDataModule
# (or nag_lightning.ByteDataModule) still load.
ByteDataModule = TextDataModule
