"""Task data for `nag-lightning fit`: sequences generated from a seed, or read from a JSONL file.

Training batches are LongTensors (batch_size, seq_len + 1), as the text data module's, so the
training loss is the same language-modelling loss on every token. Batch i of training is drawn
from a generator seeded by (seed, rank, i) alone: a run is deterministic, and its loader's state
is just the index of the next batch, which Lightning saves in every checkpoint
(`state_dict`/`load_state_dict`) so a resumed run draws exactly the batches an uninterrupted one
would. Validation batches are `Labelled` (tokens and difficulty, both (batch, seq_len + 1)) from
a separate seed stream, fixed for the run; the LightningModule scores them per difficulty level
(`nag_lightning.tasks.evaluation`).

A file of labelled sequences (`read_labelled`, format in docs/tasks.md) takes the place of a
generated task: its last `val_sequences` lines are validation, and training draws its other lines
at random.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch

from nag_lightning.data.tokenizer import Tokenizer
from nag_lightning.inputs import shorten
from nag_lightning.tasks import UNPREDICTABLE, Labelled, Task, build_task

MAX_DIFFICULTY = 2**31 - 1
"""The largest difficulty label a file may give (labels are steps a token needs; a larger number
is a mistake, and one beyond 2**63 would not fit the label tensor)."""
FILE_PAD = ord(" ")
"""The token shorter lines of a file are padded with, labelled UNPREDICTABLE (left out of scores)."""


def seeded(seed: int, stream: str, index: int = 0) -> torch.Generator:
    """A generator for one batch of one stream: distinct (seed, stream, index) never share a seed."""
    digest = hashlib.sha256(f"{seed}/{stream}/{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


class LabelledSource:
    """Where sequences come from: a generated task, or the lines of a file, drawn by a generator."""

    def __init__(self, task: Task | None = None, lines: Labelled | None = None) -> None:
        self.task, self.lines = task, lines

    @property
    def max_difficulty(self) -> int:
        if self.task is not None:
            return self.task.max_difficulty
        return int(self.lines.difficulty.max().clamp_min(0))

    def draw(self, n: int, length: int, generator: torch.Generator) -> Labelled:
        if self.task is not None:
            return self.task.sample(n, length, generator)
        pick = torch.randint(len(self.lines.tokens), (n,), generator=generator)
        return Labelled(self.lines.tokens[pick], self.lines.difficulty[pick])


def read_labelled(path: str | Path, length: int, vocab_size: int = 256) -> Labelled:
    """The labelled sequences of a JSONL file, one per line, each padded to `length` tokens with
    `FILE_PAD` labelled UNPREDICTABLE: `{"text": ..., "difficulty": [...]}` with one label per byte
    of the text's UTF-8, or `{"tokens": [...], "difficulty": [...]}`. Labels: -1 unpredictable, 0
    format, k >= 1 the steps a token needs. One sentence for the first line that breaks the format."""
    rows, labels = [], []
    try:
        handle = open(path, "rb")  # decoded line by line, so an error names its line
    except OSError as error:
        raise FileNotFoundError(f"Cannot read the labelled sequences {str(path)!r} ({error.strerror}); "
                                "give the path of a JSONL file.") from None
    with handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                where = f"{path}, line {number}"
                tokens, difficulty = _parse_line(_decoded(line, where), where, length, vocab_size)
                rows.append(tokens + [FILE_PAD] * (length - len(tokens)))
                labels.append(difficulty + [UNPREDICTABLE] * (length - len(tokens)))
    if not rows:
        raise ValueError(f"{path} holds no labelled sequences; write one JSON object per line "
                         '({"text": ..., "difficulty": [...]}, see docs/tasks.md).')
    return Labelled(torch.tensor(rows), torch.tensor(labels))


def _decoded(line: bytes, where: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{where} is not UTF-8 (byte {error.start + 1} of the line); save the file as "
                         "UTF-8.") from None


def _parse_line(line: str, where: str, length: int, vocab_size: int) -> tuple[list[int], list[int]]:
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError) as error:  # RecursionError: brackets nested too deep
        reason = shorten(getattr(error, "msg", None) or "nested too deeply")
        raise ValueError(f"{where} is not JSON ({reason}); write one JSON object per line.") from None
    if not isinstance(entry, dict) or ("text" in entry) == ("tokens" in entry) or "difficulty" not in entry:
        raise ValueError(f'{where} needs "difficulty" and exactly one of "text" and "tokens"; see '
                         "docs/tasks.md.")
    if "text" in entry:
        if not isinstance(entry["text"], str):
            raise ValueError(f'{where}: "text" must be a string.')
        tokens, unit = list(entry["text"].encode("utf-8")), "bytes of text (UTF-8)"
    else:
        tokens, unit = entry["tokens"], "tokens"
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
            raise ValueError(f'{where}: "tokens" must be a list of token ids from 0 to {vocab_size - 1}.')
    difficulty = entry["difficulty"]
    if not isinstance(difficulty, list) or not all(type(d) is int for d in difficulty):
        raise ValueError(f'{where}: "difficulty" must be a list of whole numbers, one per token.')
    if len(difficulty) != len(tokens):
        raise ValueError(f"{where} has {len(tokens)} {unit} but {len(difficulty)} difficulty labels; "
                         "give one label per token.")
    if any(d > MAX_DIFFICULTY for d in difficulty):
        raise ValueError(f"{where} has a difficulty label above {MAX_DIFFICULTY:,}; use -1 (unpredictable), "
                         "0 (format) or the number of steps a token needs.")
    if any(d < UNPREDICTABLE for d in difficulty):
        raise ValueError(f"{where} has a difficulty label below -1; use -1 (unpredictable), 0 (format) "
                         "or the number of steps a token needs.")
    if not 2 <= len(tokens) <= length:
        raise ValueError(f"{where} has {len(tokens)} tokens; a sequence needs from 2 to data.seq_len + 1 "
                         f"= {length}: split it or raise data.seq_len.")
    return tokens, difficulty


class TrainBatches:
    """The training loader: batch i drawn from `seeded(seed, stream, i)`, `epoch_batches` a pass.

    Its state is the index of the next batch. Lightning reads it into checkpoints and restores it
    on resume, and, knowing the length, fetches no batch ahead, so the saved index is exactly the
    number of batches trained on.
    """

    def __init__(self, source: LabelledSource, batch_size: int, length: int, seed: int, stream: str,
                 epoch_batches: int) -> None:
        self.source, self.batch_size, self.length = source, batch_size, length
        self.seed, self.stream, self.epoch_batches = seed, stream, epoch_batches
        self.index = 0

    def __len__(self) -> int:
        return self.epoch_batches

    def __iter__(self) -> Iterator[torch.Tensor]:
        # a resumed pass ends where the uninterrupted one would
        end = (self.index // self.epoch_batches + 1) * self.epoch_batches
        while self.index < end:
            generator = seeded(self.seed, self.stream, self.index)
            self.index += 1
            yield self.source.draw(self.batch_size, self.length, generator).tokens

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        index = state.get("index")
        if type(index) is not int or index < 0:
            raise ValueError(f"The checkpoint's task loader state {shorten(repr(state))} holds no batch "
                             "index; resume from a checkpoint of a run on task data.")
        self.index = index


class TaskDataModule(L.LightningDataModule):
    """Sequences of a synthetic task whose every token is labelled with its difficulty, or the
    labelled sequences of a file; bytes (vocab 256), so bits per byte and `generate` work as on text.

    Training batches are LongTensors (batch_size, seq_len + 1); validation batches are `Labelled`.
    """

    def __init__(
        self,
        task: str = "hops",
        task_options: dict[str, Any] | None = None,
        seq_len: int = 256,
        batch_size: int = 16,
        seed: int = 42,
        val_sequences: int = 256,
        epoch_batches: int = 1000,
        file: str | None = None,
    ) -> None:
        """
        Args:
            task: the registered task to generate ("hops": k-hop pointer chasing; "state": the word
                problem of a permutation group); ignored when `file` is given.
            task_options: the task's keyword options, e.g. {n_nodes: 16, max_hops: 8}.
            seq_len: tokens of context per sample; each sample has seq_len + 1 tokens.
            batch_size: samples per batch on each device.
            seed: seed of every sequence drawn; training batch i depends on (seed, i) alone.
            val_sequences: validation sequences, from their own seed stream (with `file`: the file's
                last lines).
            epoch_batches: training batches per epoch (the stream has no end; with
                trainer.max_steps set, an epoch only paces validation and logging).
            file: a JSONL file of labelled sequences to use instead of a generated task, one per
                line (format in docs/tasks.md).
        """
        super().__init__()
        for name, value, least in (("seq_len", seq_len, 2), ("batch_size", batch_size, 1),
                                   ("val_sequences", val_sequences, 1), ("epoch_batches", epoch_batches, 1)):
            if value < least:
                raise ValueError(f"data.{name} must be at least {least}; got {value}.")
        self.save_hyperparameters()
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.val_sequences, self.epoch_batches, self.file = val_sequences, epoch_batches, file
        self.tokenizer = Tokenizer()
        self.train_source, self.val_set = self._sources(task, task_options or {})

    @property
    def vocab_size(self) -> int:
        """Number of token ids: 256, bytes."""
        return self.tokenizer.vocab_size

    @property
    def max_difficulty(self) -> int:
        """The hardest difficulty label of the data."""
        return self.train_source.max_difficulty

    def _sources(self, task: str, options: dict) -> tuple[LabelledSource, Labelled]:
        length = self.seq_len + 1
        if self.file is not None:
            lines = read_labelled(self.file, length, self.vocab_size)
            if len(lines.tokens) <= self.val_sequences:
                raise ValueError(f"data.file={self.file!r} holds {len(lines.tokens)} sequences, not more "
                                 f"than data.val_sequences={self.val_sequences}; lower data.val_sequences or "
                                 "give more lines.")
            cut = len(lines.tokens) - self.val_sequences
            return (LabelledSource(lines=Labelled(lines.tokens[:cut], lines.difficulty[:cut])),
                    Labelled(lines.tokens[cut:], lines.difficulty[cut:]))
        generator = build_task(task, **options)
        if length < generator.min_length():
            raise ValueError(f"data.seq_len + 1 = {length} tokens cannot hold one episode of "
                             f"{generator.describe()}, which needs {generator.min_length()}; raise "
                             "data.seq_len (model.arch.seq_len) or shrink the task.")
        source = LabelledSource(task=generator)
        return source, source.draw(self.val_sequences, length, seeded(self.seed, "val"))

    def _rank(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)

    def train_dataloader(self) -> TrainBatches:
        """Batch i from the seed stream (seed, rank, i); each rank draws its own batches."""
        rank, _ = self._rank()
        return TrainBatches(self.train_source, self.batch_size, self.seq_len + 1, self.seed,
                            f"train/{rank}", self.epoch_batches)

    def val_dataloader(self) -> Batches:
        """The validation sequences, `Labelled`, in batches of `batch_size`, each rank its share."""
        return Batches(self.val_set, self.batch_size, *self._rank())

    def test_dataloader(self) -> Batches:
        """The validation sequences' tokens alone (a task has no third split): `test` reports bits
        per byte, as on text."""
        return Batches(self.val_set, self.batch_size, *self._rank(), labelled=False)


class Batches:
    """Fixed sequences in batches, rank `rank` of `world` taking every world-th batch: `Labelled`, or
    the tokens alone. Not a list, which Lightning would take for several loaders."""

    def __init__(self, sequences: Labelled, batch_size: int, rank: int = 0, world: int = 1,
                 labelled: bool = True) -> None:
        starts = range(rank * batch_size, len(sequences.tokens), world * batch_size)
        self.batches = [Labelled(sequences.tokens[i:i + batch_size], sequences.difficulty[i:i + batch_size])
                        for i in starts]
        self.labelled = labelled

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Labelled | torch.Tensor]:
        return iter(self.batches if self.labelled else [b.tokens for b in self.batches])
