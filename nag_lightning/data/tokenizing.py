"""Tokenizing byte ranges into litdata chunks, with litdata's `optimize`, in a child process.

Raw bytes are read as uint8 tokens; any other tokenizer encodes pieces cut where the pre-tokenizer
would cut anyway, so the ids are those of the whole range.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
from litdata import TokensLoader, optimize

from nag_lightning.data import bpe_training
from nag_lightning.data import tokenizer as tokenizers
from nag_lightning.data.orphans import die_with_parent
from nag_lightning.data.tokenizer import Tokenizer

# Chunk files of ~16 MB. The shuffle permutes chunk order, then the blocks inside each chunk; a
# block never straddles two chunks, so each chunk's last (< seq_len + 1) bytes are never read.
_CHUNK_BYTES = "16MB"
_READ_BYTES = 1 << 22  # `optimize` receives a file in pieces of at most 4 MiB
# Forking starts litdata's worker in ~0.1 s; spawning re-imports torch, ~10 s per `optimize` call.
START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"


def _read_range(piece: tuple[str, int, int]) -> Iterator[tuple[bytes, bool]]:
    """A byte range of one file, 4 MiB at a time, each chunk with whether it is the range's last."""
    path, start, end = piece
    with open(path, "rb") as f:
        f.seek(start)
        while start < end:
            data = f.read(min(_READ_BYTES, end - start))
            if not data:  # the file shrank since it was listed
                return
            start += len(data)
            yield data, start >= end


def _read_tokens(piece: tuple[str, int, int]) -> Iterator[torch.Tensor]:
    """litdata `optimize` worker: yield a byte range of one file as uint8 tokens."""
    for data, _ in _read_range(piece):
        yield torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _encode_tokens(piece: tuple[str, int, int], tokenizer: Tokenizer) -> Iterator[torch.Tensor]:
    """litdata `optimize` worker for a tokenizer other than bytes: yield the token ids of a byte
    range of one file, read 4 MiB at a time and cut only where a GPT-2-style pre-tokenizer ends a
    token anyway (`nag_lightning.data.tokenizer.safe_cut`), so the ids are those of the whole range."""
    carry = b""
    for data, last in _read_range(piece):
        data = carry + data
        cut = len(data) if last else tokenizers.safe_cut(data)
        carry, data = (data[cut:], data[:cut]) if cut > 0 else (b"", data)
        if data:
            yield tokenizer.encode(data)
    if carry:
        yield tokenizer.encode(carry)


def tokenize_with(
    tokenizer: Tokenizer, splits: dict[str, list[tuple[str, int, int]]], output_dir: Path
) -> None:
    """`tokenize` with `tokenizer`, then how many bytes a sample's tokens stand for against the
    sample's own bytes (`tokenizer.coverage`), written to `coverage.json` for the meta file. Meant
    to run in a child process: the tokenizer's thread pool stays out of the training process."""
    tokenize(splits, output_dir, partial(_encode_tokens, tokenizer=tokenizer))
    sample = bpe_training.read_head(splits["train"], bpe_training.COVERAGE_SAMPLE_BYTES)
    (output_dir / "coverage.json").write_text(json.dumps(bpe_training.coverage(tokenizer, sample)))


def tokenize(
    splits: dict[str, list[tuple[str, int, int]]],
    output_dir: Path,
    read: Callable[[tuple[str, int, int]], Iterator[torch.Tensor]] | None = None,
) -> None:
    """Run litdata `optimize` once per split with `read` (default: the bytes of `_read_tokens`,
    looked up at call time); meant to run in a child process (see `in_child`)."""
    # litdata stages files in $TMPDIR/chunks and $TMPDIR/data and deletes both on every run, even
    # those of other jobs: point them into our own temporary folder.
    os.environ["DATA_OPTIMIZER_CACHE_FOLDER"] = str(output_dir / ".litdata" / "chunks")
    os.environ["DATA_OPTIMIZER_DATA_CACHE_FOLDER"] = str(output_dir / ".litdata" / "data")
    for split, pieces in splits.items():
        # One worker, inputs in order: the token stream is the files in sorted order, the same on
        # every run (several workers would interleave files in whatever order they finish).
        optimize(
            fn=read or _read_tokens,
            inputs=pieces,
            output_dir=str(output_dir / split),
            chunk_bytes=_CHUNK_BYTES,
            item_loader=TokensLoader(),
            num_workers=1,
            reorder_files=False,
            keep_data_ordered=True,
            start_method=START_METHOD,
            verbose=False,
        )
    shutil.rmtree(output_dir / ".litdata", ignore_errors=True)


def in_child(fn: Callable[..., None], *args: Any) -> None:
    """Run `fn` in a child process and re-raise its error here.

    `optimize` changes global state of the process that calls it: it reseeds `random`, NumPy and
    torch with 42 (so a run that tokenizes would train differently from one that hits the cache),
    forces the multiprocessing start method and sets environment variables. A child keeps all of
    that out of the training process. The child and the workers it forks die with this process.
    """
    context = multiprocessing.get_context(START_METHOD)
    with ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        pool.submit(fn, *args).result()
