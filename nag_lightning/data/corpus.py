"""A corpus: the text files a `data.source` names (the Python standard library by default), their
byte ranges per split, the hash that keys their token cache, and a prepared folder's chunk index."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

from nag_lightning.data.filesystem import CACHEDIR_TAG, is_litdata, is_remote, is_text

# Bump when the on-disk layout or the split rule changes, so old caches are not reused.
_CACHE_VERSION = 1
META = "meta.json"
TOKENIZER = "tokenizer.json"
# The default corpus, the interpreter's own standard library, is about 32 MB of .py (Python 3.11,
# tests included), tokenized in about a second on 2 CPU cores. The cap bounds other builds.
DEFAULT_STDLIB_MAX_BYTES = 64 * 2**20
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    """The running interpreter's standard-library `.py` files, sorted; installed packages excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def _files_under(folder: Path) -> list[Path]:
    """Text files under `folder`, recursively, sorted; hidden entries and caches skipped."""
    files = []
    for sub, dirs, names in os.walk(folder):
        if CACHEDIR_TAG in names:  # e.g. our own cache_dir inside the corpus folder
            dirs[:] = []
            continue
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS]
        files += [Path(sub, n) for n in names if not n.startswith(".")]
    return sorted(f for f in files if f.is_file() and is_text(f))


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


def local_uris(source: str | list[str] | None) -> str | list[str] | None:
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


def optimized_dir(source: str | list[str] | None) -> str | None:
    """Return `source` if it is already tokenized (object-store URI or folder with train/ and val/)."""
    if not isinstance(source, str):
        return None
    if is_remote(source):
        return source.rstrip("/")
    path = Path(source).expanduser()
    if is_litdata(path / "train") and is_litdata(path / "val"):
        return str(path.resolve())
    if is_litdata(path):
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


def corpus_hash(
    files: list[Path], val_fraction: float, max_bytes: int | None, tokenizer_key: str | None = None
) -> str:
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    settings = [_CACHE_VERSION, stats, val_fraction, max_bytes]
    if tokenizer_key is not None:  # bytes keep the key they always had, so their caches stay valid
        settings.append(tokenizer_key)
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]


def too_short(split: str, size: int, block: int, unit: str = "bytes") -> ValueError:
    if block <= 1:
        return ValueError(
            f"The {split} split of the corpus is empty; change data.val_fraction or give more text."
        )
    return ValueError(
        f"The {split} split of the corpus has {size} {unit}, fewer than one sequence of "
        f"data.seq_len + 1 = {block} {unit}; lower data.seq_len or data.val_fraction, "
        "or give more text."
    )


def plan(
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
            raise too_short(name, size, (seq_len or 0) + 1)
    return files, splits, sizes, max_bytes


def check_fraction(val_fraction: float) -> None:
    if not 0 < val_fraction < 1:
        raise ValueError(
            f"data.val_fraction must be between 0 and 1 (exclusive), got {val_fraction}; "
            "0.05 keeps the last 5% of every file for validation."
        )


def token_counts(prepared: str | Path) -> dict[str, int]:
    """Number of tokens (bytes, for the byte tokenizer) in the train and val splits of a prepared
    folder."""
    return {split: sum(c["dim"] for c in split_chunks(Path(prepared) / split)) for split in ("train", "val")}


def split_chunks(split_dir: Path) -> list[dict]:
    return json.loads((split_dir / "index.json").read_text())["chunks"]
