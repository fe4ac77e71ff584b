"""Language-modelling data: text -> litdata token chunks -> streaming batches.

Text is tokenized ONCE, in `prepare_corpus`, into litdata chunks under `cache_dir/<hash>/{train,val}`:
by default as raw bytes (vocab 256, one token per byte), or with the tokenizer `data.tokenizer`
names (`nag_lightning.tokenizer`: a Hugging Face tokenizer.json, or a byte-level BPE trained here on
the training split and cached under `cache_dir/tokenizers/`). Training then streams fixed blocks of
`seq_len + 1` tokens with litdata's `StreamingDataset` + `TokensLoader`, read by a
`StreamingDataLoader`, so sharding across ranks and workers and mid-epoch resume come from litdata
(Lightning stores a stateful loader's `state_dict()` in every checkpoint and restores it on resume).

    files --(last val_fraction of each file's bytes)--> val/   chunk-*.bin + index.json
          --(the rest)--------------------------------> train/ chunk-*.bin + index.json

The hash covers the resolved files (paths, sizes, mtimes), `val_fraction`, `max_bytes` and, for any
tokenizer but bytes, the tokenizer itself (its tokenizer.json), so a second run reuses the cache, a
changed corpus re-tokenizes and two tokenizers never share chunks. `seq_len` is not in the hash: the
chunks are one flat token stream, cut into blocks only when read. A tokenized folder holds its
tokenizer.json beside the chunks, so it is a complete `data.source` by itself.
"""

from __future__ import annotations

import glob
import hashlib
import inspect
import json
import multiprocessing
import os
import shutil
import sys
import sysconfig
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlparse
from urllib.request import url2pathname

import lightning as L
import torch
from litdata import StreamingDataLoader, StreamingDataset, TokensLoader, optimize

from nag_lightning import tokenizer as tokenizers
from nag_lightning.orphans import die_with_parent, owned_name, remove_orphaned
from nag_lightning.tokenizer import HFTokenizer, Tokenizer

# Bump when the on-disk layout or the split rule changes, so old caches are not reused.
_CACHE_VERSION = 1
_META = "meta.json"
_TOKENIZER = "tokenizer.json"
# Chunk files of ~16 MB. The shuffle permutes chunk order, then the blocks inside each chunk; a
# block never straddles two chunks, so each chunk's last (< seq_len + 1) bytes are never read.
_CHUNK_BYTES = "16MB"
_READ_BYTES = 1 << 22  # `optimize` receives a file in pieces of at most 4 MiB
# The default corpus, the interpreter's own standard library, is about 32 MB of .py (Python 3.11,
# tests included), tokenized in about a second on 2 CPU cores. The cap bounds other builds.
DEFAULT_STDLIB_MAX_BYTES = 64 * 2**20
# Forking starts litdata's worker in ~0.1 s; spawning re-imports torch, ~10 s per `optimize` call.
_START_METHOD = "fork" if sys.platform.startswith("linux") else "spawn"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# Marks cache_dir as a cache (https://bford.info/cachedir/): corpus scans and backups skip it.
_CACHEDIR_TAG = "CACHEDIR.TAG"
_CACHEDIR_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55\n# nag-lightning token cache\n"


def stdlib_files() -> list[Path]:
    """The running interpreter's standard-library `.py` files, sorted; installed packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def _is_text(path: Path) -> bool:
    """A file is text unless its first 8 KiB hold a NUL byte (the rule git and grep use)."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def _files_under(folder: Path) -> list[Path]:
    """Text files under `folder`, recursively, sorted; hidden entries and caches skipped."""
    files = []
    for sub, dirs, names in os.walk(folder):
        if _CACHEDIR_TAG in names:  # e.g. our own cache_dir inside the corpus folder
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS]
        files += [Path(sub, n) for n in names if not n.startswith(".")]
    return sorted(f for f in files if f.is_file() and _is_text(f))


def resolve_files(source: str | list[str] | None) -> list[Path]:
    """Expand `source` (None = stdlib, or files, directories and globs) into a sorted file list."""
    if source is None:
        return stdlib_files()
    files: list[Path] = []
    for item in [source] if isinstance(source, str) else source:
        path = Path(item).expanduser()
        if path.is_dir():
            files += _files_under(path)
        elif path.is_file():
            files.append(path)
        elif glob.has_magic(item):
            matches = sorted(glob.glob(os.path.expanduser(item), recursive=True))
            if not matches:
                raise FileNotFoundError(
                    f"The glob {item!r} in data.source matches no files; check the pattern "
                    "(use '**' to search subdirectories)."
                )
            for m in map(Path, matches):
                files += _files_under(m) if m.is_dir() else [m] if m.is_file() else []
        else:
            raise FileNotFoundError(
                f"{item!r} does not exist; give an existing file, directory or glob in data.source."
            )
    return list(dict.fromkeys(f.resolve() for f in files))  # drop duplicates, keep order


def _is_remote(source: str) -> bool:
    return "://" in source


def check_source(source: str | list[str] | None) -> None:
    """Refuse an empty `source`, an empty list or an empty item of one: an empty path is the
    working directory, and training on every file under it is never what was meant."""
    items = [source] if isinstance(source, str) else source
    if items is None:
        return
    if not items or any(not str(item).strip() for item in items):
        raise ValueError(
            f"data.source={source!r} names no text; give a file, folder, glob or URI (or a list of "
            "them), or leave data.source out to train on the Python standard library."
        )


def _local_uris(source: str | list[str] | None) -> str | list[str] | None:
    """`source` with file:// URIs turned into the local paths they name."""
    check_source(source)
    if isinstance(source, list):
        return [_local_uri(item) for item in source]
    return source if source is None else _local_uri(source)


def _local_uri(item: str) -> str:
    if not item.startswith("file:"):
        return item
    uri = urlparse(item)
    if uri.netloc not in ("", "localhost"):
        raise ValueError(
            f"data.source {item!r} names a file on another host ({uri.netloc}); give a local path "
            "or an object-store URI such as s3://bucket/folder."
        )
    return url2pathname(uri.path)


def _is_litdata(folder: Path) -> bool:
    """Whether `folder` holds a litdata index (and not just any file named index.json)."""
    try:
        index = json.loads((folder / "index.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and {"chunks", "config"} <= index.keys()


def optimized_dir(source: str | list[str] | None) -> str | None:
    """Return `source` if it is already tokenized (object-store URI or folder with train/ and val/)."""
    if not isinstance(source, str):
        return None
    if _is_remote(source):
        return source.rstrip("/")
    path = Path(source).expanduser()
    if _is_litdata(path / "train") and _is_litdata(path / "val"):
        return str(path.resolve())
    if _is_litdata(path):
        raise ValueError(
            f"{source!r} is one optimized litdata dataset, but data.source needs a folder holding "
            "two, train/ and val/; give the text instead, or a folder from `nag-lightning prepare`."
        )
    return None


def _cap(files: list[Path], max_bytes: int | None) -> list[Path]:
    """The leading files that hold the first `max_bytes` bytes (the last one possibly cut)."""
    if max_bytes is None:
        return files
    kept, total = [], 0
    for f in files:
        if total >= max_bytes:
            break
        kept.append(f)
        total += f.stat().st_size
    return kept


def _split(
    files: list[Path], val_fraction: float, max_bytes: int | None
) -> dict[str, list[tuple[str, int, int]]]:
    """Byte ranges (path, start, end) per split: the last `val_fraction` of each file's bytes is
    validation, so the split is deterministic, disjoint and works for a single file."""
    splits: dict[str, list[tuple[str, int, int]]] = {"train": [], "val": []}
    budget = max_bytes if max_bytes is not None else float("inf")
    for f in files:
        size = int(min(f.stat().st_size, budget))
        budget -= size
        cut = size - round(size * val_fraction)
        splits["train"] += [(str(f), 0, cut)] if cut > 0 else []
        splits["val"] += [(str(f), cut, size)] if size > cut else []
    return splits


def _corpus_hash(
    files: list[Path], val_fraction: float, max_bytes: int | None, tokenizer_key: str | None = None
) -> str:
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    settings = [_CACHE_VERSION, stats, val_fraction, max_bytes]
    if tokenizer_key is not None:  # bytes keep the key they always had, so their caches stay valid
        settings.append(tokenizer_key)
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]


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
    token anyway (`nag_lightning.tokenizer.safe_cut`), so the ids are those of the whole range."""
    carry = b""
    for data, last in _read_range(piece):
        data = carry + data
        cut = len(data) if last else tokenizers.safe_cut(data)
        carry, data = (data[cut:], data[:cut]) if cut > 0 else (b"", data)
        if data:
            yield tokenizer.encode(data)
    if carry:
        yield tokenizer.encode(carry)


def _tokenize_with(
    tokenizer: Tokenizer, splits: dict[str, list[tuple[str, int, int]]], output_dir: Path
) -> None:
    """`_tokenize` with `tokenizer`, then how many bytes a sample's tokens stand for against the
    sample's own bytes (`tokenizer.coverage`), written to `coverage.json` for the meta file. Meant
    to run in a child process: the tokenizer's thread pool stays out of the training process."""
    _tokenize(splits, output_dir, partial(_encode_tokens, tokenizer=tokenizer))
    sample = tokenizers.read_head(splits["train"], tokenizers.COVERAGE_SAMPLE_BYTES)
    (output_dir / "coverage.json").write_text(json.dumps(tokenizers.coverage(tokenizer, sample)))


def _tokenize(
    splits: dict[str, list[tuple[str, int, int]]],
    output_dir: Path,
    read: Callable[[tuple[str, int, int]], Iterator[torch.Tensor]] | None = None,
) -> None:
    """Run litdata `optimize` once per split with `read` (default: the bytes of `_read_tokens`,
    looked up at call time); meant to run in a child process (see `_in_child`)."""
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
            start_method=_START_METHOD,
            verbose=False,
        )
    shutil.rmtree(output_dir / ".litdata", ignore_errors=True)


def _in_child(fn: Callable[..., None], *args: Any) -> None:
    """Run `fn` in a child process and re-raise its error here.

    `optimize` changes global state of the process that calls it: it reseeds `random`, NumPy and
    torch with 42 (so a run that tokenizes would train differently from one that hits the cache),
    forces the multiprocessing start method and sets environment variables. A child keeps all of
    that out of the training process. The child and the workers it forks die with this process.
    """
    context = multiprocessing.get_context(_START_METHOD)
    with ProcessPoolExecutor(max_workers=1, mp_context=context, initializer=die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        pool.submit(fn, *args).result()


def _too_short(split: str, size: int, block: int, unit: str = "bytes") -> ValueError:
    if block <= 1:
        return ValueError(
            f"The {split} split of the corpus is empty; change data.val_fraction or give more text."
        )
    return ValueError(
        f"The {split} split of the corpus has {size} {unit}, fewer than one sequence of "
        f"data.seq_len + 1 = {block} {unit}; lower data.seq_len or data.val_fraction, "
        "or give more text."
    )


def _plan(
    source: str | list[str] | None, val_fraction: float, max_bytes: int | None, seq_len: int | None
) -> tuple[list[Path], dict[str, list[tuple[str, int, int]]], dict[str, int], int | None]:
    """The files of a text `source`, their byte ranges per split, the bytes per split and the
    byte cap in force; one sentence if the corpus is empty or a split shorter than a sequence."""
    if max_bytes is None and source is None:
        max_bytes = DEFAULT_STDLIB_MAX_BYTES
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"data.max_bytes must be positive or null (no cap), got {max_bytes}.")
    files = _cap(resolve_files(source), max_bytes)
    splits = _split(files, val_fraction, max_bytes)
    sizes = {name: sum(end - start for _, start, end in pieces) for name, pieces in splits.items()}
    if sum(sizes.values()) == 0:
        raise ValueError(
            f"The corpus in data.source={source!r} is empty ({len(files)} files, 0 bytes); give "
            "files that contain text (in folders, files holding NUL bytes are skipped as binary)."
        )
    for name, size in sizes.items():
        if size < (seq_len or 0) + 1:
            raise _too_short(name, size, (seq_len or 0) + 1)
    return files, splits, sizes, max_bytes


def prepare_corpus(
    source: str | list[str] | None = None,
    cache_dir: str | Path = "data_cache",
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
    seq_len: int | None = None,
    tokenizer: str = tokenizers.BYTES,
) -> Path | str:
    """Tokenize `source` into `cache_dir/<hash>/{train,val}` once; return that folder.

    A complete cache for the same files and tokenizer is reused as is. Writing goes to a temporary
    folder renamed into place at the end, so an interrupted run never leaves a cache that looks
    complete. An already optimized `source` (see `optimized_dir`) is returned unchanged (a URI stays
    a string). With `seq_len`, each split must hold at least one sequence of `seq_len + 1` bytes.
    `tokenizer` is "bytes", "bpe:<vocab size>" (trained on the training split, cached under
    `cache_dir/tokenizers/`) or the path of a Hugging Face tokenizer.json.
    """
    _check_fraction(val_fraction)
    source = _local_uris(source)
    if (ready := optimized_dir(source)) is not None:
        prepared_tokenizer(ready, tokenizer)  # refuses a tokenizer the folder was not made with
        return ready if _is_remote(ready) else Path(ready)
    files, splits, sizes, max_bytes = _plan(source, val_fraction, max_bytes, seq_len)
    tok = _corpus_tokenizer(tokenizer, files, splits, val_fraction, max_bytes, cache_dir)
    key = None if tok.key == tokenizers.BYTES else f"{tok.key}-{tokenizers.ENCODE_VERSION}"
    target = Path(cache_dir).expanduser().resolve() / _corpus_hash(files, val_fraction, max_bytes, key)
    if (target / _META).is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / _CACHEDIR_TAG).write_text(_CACHEDIR_SIGNATURE)
        remove_orphaned(target.parent)  # what killed runs left; live runs' folders stay
        tmp = target.parent / owned_name(target.name)
        tmp.mkdir()
    except OSError as error:
        raise _unwritable(cache_dir, error) from None
    try:
        if key is None:
            _in_child(_tokenize, splits, tmp)
        else:
            _in_child(_tokenize_with, tok, splits, tmp)
            (tmp / _TOKENIZER).write_text(tok.json_text, encoding="utf-8")
        meta = {
            "source": source or "stdlib",
            "files": len(files),
            "val_fraction": val_fraction,
            "max_bytes": max_bytes,
            **{f"{name}_bytes": size for name, size in sizes.items()},
            "tokenizer": tok.spec,
            "vocab_size": tok.vocab_size,
        }
        if key is not None:
            meta["coverage"] = _coverage(tmp, tok)
        (tmp / _META).write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same cache first: keep theirs
            if not (target / _META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(
    spec: str = tokenizers.BYTES,
    source: str | list[str] | None = None,
    cache_dir: str | Path = "data_cache",
    val_fraction: float = 0.05,
    max_bytes: int | None = None,
) -> Tokenizer:
    """The tokenizer `spec` names for this corpus (see `prepare_corpus`). A BPE is trained on the
    corpus's training split the first time and read from `cache_dir/tokenizers/` after that; an
    already tokenized `source` brings its own."""
    _check_fraction(val_fraction)
    source = _local_uris(source)
    if (ready := optimized_dir(source)) is not None:
        return prepared_tokenizer(ready, spec)
    kind, _ = tokenizers.parse_spec(spec)
    if kind == tokenizers.BYTES:
        return Tokenizer()
    if kind == "file":
        return tokenizers.load_file(spec)
    files, splits, _, max_bytes = _plan(source, val_fraction, max_bytes, None)
    return _corpus_tokenizer(spec, files, splits, val_fraction, max_bytes, cache_dir)


def _corpus_tokenizer(
    spec: str,
    files: list[Path],
    splits: dict[str, list[tuple[str, int, int]]],
    val_fraction: float,
    max_bytes: int | None,
    cache_dir: str | Path,
) -> Tokenizer:
    kind, vocab_size = tokenizers.parse_spec(spec)
    if kind == tokenizers.BYTES:
        return Tokenizer()
    if kind == "file":
        return tokenizers.load_file(spec)
    # Keyed by everything the merges depend on: the training split, the vocabulary size, the
    # sample size and the recipe's version.
    settings = [tokenizers.BPE_VERSION, _corpus_hash(files, val_fraction, max_bytes), vocab_size,
                tokenizers.BPE_SAMPLE_BYTES]
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]
    folder = Path(cache_dir).expanduser().resolve() / "tokenizers"
    file = folder / f"bpe{vocab_size}-{key}.json"
    if not file.is_file():
        tmp = folder / f".{file.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder.parent / _CACHEDIR_TAG).write_text(_CACHEDIR_SIGNATURE)
        except OSError as error:
            raise _unwritable(cache_dir, error) from None
        try:
            sample = tokenizers.sample_pieces(splits["train"], tokenizers.BPE_SAMPLE_BYTES)
            _in_child(_train_bpe, sample, vocab_size, tmp)
            tmp.replace(file)  # atomic: a concurrent run that trained the same BPE wrote the same
        finally:
            tmp.unlink(missing_ok=True)
    return HFTokenizer(file.read_text(encoding="utf-8"), spec=spec)


def _train_bpe(pieces: list[tuple[str, int, int]], vocab_size: int, out: Path) -> None:
    """Train the BPE on `pieces` and write its tokenizer.json (in a child process, see `_in_child`:
    the trainer's thread pool would otherwise make every later fork of this process warn)."""
    texts: Iterable[str] | Iterable[bytes] = (data.decode("utf-8") for data in tokenizers.read_pieces(pieces))
    try:
        json_text = tokenizers.train_bpe(texts, vocab_size)
    except UnicodeDecodeError:  # not all UTF-8: train on the bytes as they are (slower)
        json_text = tokenizers.train_bpe(tokenizers.read_pieces(pieces), vocab_size)
    out.write_text(json_text, encoding="utf-8")


def prepared_tokenizer(root: str, spec: str = tokenizers.BYTES) -> Tokenizer:
    """The tokenizer an already tokenized folder was made with (its tokenizer.json; bytes without
    one); one sentence if `spec` names another. An object store's folder is not read here: it is
    taken to hold what `spec` names, which must then be bytes or a tokenizer.json."""
    kind, _ = tokenizers.parse_spec(spec)
    if _is_remote(root):
        if kind == "bpe":
            raise ValueError(
                f"data.source {root!r} is already tokenized, and data.tokenizer={spec!r} would train "
                "a BPE on text; give the tokenizer.json the folder was tokenized with instead."
            )
        return Tokenizer() if kind == tokenizers.BYTES else tokenizers.load_file(spec)
    folder = Path(root)
    try:
        meta = json.loads((folder / _META).read_text())
    except (OSError, ValueError):
        meta = {}
    if (folder / _TOKENIZER).is_file():
        made_with: Tokenizer = HFTokenizer(
            (folder / _TOKENIZER).read_text(encoding="utf-8"), meta.get("tokenizer", str(folder / _TOKENIZER))
        )
    else:
        made_with = Tokenizer()
    if kind == tokenizers.BYTES or spec == made_with.spec:
        return made_with
    if kind == "file" and tokenizers.load_file(spec).key == made_with.key:
        return made_with
    raise ValueError(
        f"data.source {root!r} was tokenized with {made_with.describe()}, not data.tokenizer="
        f"{spec!r}; leave data.tokenizer at its default to use the folder's own, or give the text "
        "to tokenize it again."
    )


def _coverage(folder: Path, tokenizer: Tokenizer) -> dict[str, float]:
    """The bytes a sample's tokens stand for against its own (written by `_tokenize_with`), and a
    warning when they differ: bits per byte is then per decoded byte, not per byte of the text."""
    file = folder / "coverage.json"
    found = json.loads(file.read_text())
    file.unlink()
    if abs(found["token_bytes"] - found["bytes"]) > 0.001 * found["bytes"]:
        warnings.warn(
            f"{tokenizer.describe()} turns {found['bytes']} bytes of the corpus into tokens that stand "
            f"for {found['token_bytes']} bytes (it normalizes text, reads bytes that are not UTF-8 as "
            "U+FFFD, or its ids lack definite bytes), so bits per byte counts the bytes its tokens "
            "decode to; a byte-level tokenizer avoids this.",
            stacklevel=2,
        )
    return found


def _unwritable(cache_dir: str | Path, error: OSError) -> ValueError:
    if Path(cache_dir).expanduser().is_file():
        return ValueError(
            f"data.cache_dir={str(cache_dir)!r} is a file, not a folder; give a folder for the "
            "token cache (it is created if missing)."
        )
    return ValueError(
        f"data.cache_dir={str(cache_dir)!r} cannot hold the token cache ({error.strerror or error}: "
        f"{error.filename or cache_dir}); give a folder you can write to."
    )


def _unreachable(root: str, error: Exception) -> ValueError:
    """One sentence for an object-store dataset that could not be opened."""
    if "Credential" in type(error).__name__:  # botocore's NoCredentialsError and its kin
        return ValueError(
            f"No credentials were found to read data.source {root!r}; configure them (e.g. "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or `aws configure` for "
            "s3://) or copy the data to a local folder and give that."
        )
    return ValueError(
        f"data.source {root!r} could not be opened ({type(error).__name__}: {error}); check the "
        "address, your network and your access to it, or copy the data to a local folder."
    )


def token_counts(prepared: str | Path) -> dict[str, int]:
    """Number of tokens (bytes, for the byte tokenizer) in the train and val splits of a prepared
    folder."""
    return {split: sum(c["dim"] for c in _chunks(Path(prepared) / split)) for split in ("train", "val")}


def _chunks(split_dir: Path) -> list[dict]:
    return json.loads((split_dir / "index.json").read_text())["chunks"]


def _check_fraction(val_fraction: float) -> None:
    if not 0 < val_fraction < 1:
        raise ValueError(
            f"data.val_fraction must be between 0 and 1 (exclusive), got {val_fraction}; "
            "0.05 keeps the last 5% of every file for validation."
        )


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


class ByteDataModule(L.LightningDataModule):
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
        _check_fraction(val_fraction)
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
        if _is_remote(str(root)):  # downloaded chunks go under cache_dir, not ~/.lightning/chunks
            key = hashlib.sha256(str(root).encode()).hexdigest()[:16]
            remote_cache = str(Path(self.cache_dir).expanduser().resolve() / "remote" / key / split)
        else:
            chunks = _chunks(Path(root, split))
            if sum(c["dim"] // block for c in chunks) == 0:  # blocks never straddle two chunks
                unit = "bytes" if self.tokenizer.key == tokenizers.BYTES else "tokens"
                raise _too_short(split, sum(c["dim"] for c in chunks), block, unit)
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
            raise _unreachable(str(root), error) from None

    def _loader(self, dataset: StreamingDataset | None) -> StreamingDataLoader:
        if dataset is None:
            raise RuntimeError("Call ByteDataModule.setup() before asking for a dataloader.")
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
