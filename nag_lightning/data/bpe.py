"""The tokenizer of a corpus: bytes, a Hugging Face tokenizer.json, or a byte-level BPE trained
here on the training split (in a child process) and cached under `cache_dir/tokenizers/`; and the
tokenizer an already tokenized folder was made with."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterable
from pathlib import Path

from nag_lightning.data import bpe_training, tokenizing
from nag_lightning.data import tokenizer as tokenizers
from nag_lightning.data.corpus import (
    META,
    TOKENIZER,
    check_fraction,
    corpus_hash,
    local_uris,
    optimized_dir,
    plan,
)
from nag_lightning.data.filesystem import CACHEDIR_SIGNATURE, CACHEDIR_TAG, is_remote, unwritable
from nag_lightning.data.tokenizer import HFTokenizer, Tokenizer


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
    check_fraction(val_fraction)
    source = local_uris(source)
    if (ready := optimized_dir(source)) is not None:
        return prepared_tokenizer(ready, spec)
    kind, _ = tokenizers.parse_spec(spec)
    if kind == tokenizers.BYTES:
        return Tokenizer()
    if kind == "file":
        return tokenizers.load_file(spec)
    files, splits, _, max_bytes = plan(source, val_fraction, max_bytes, None)
    return corpus_tokenizer(spec, files, splits, val_fraction, max_bytes, cache_dir)


def corpus_tokenizer(
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
    settings = [tokenizers.BPE_VERSION, corpus_hash(files, val_fraction, max_bytes), vocab_size,
                bpe_training.BPE_SAMPLE_BYTES]
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:16]
    folder = Path(cache_dir).expanduser().resolve() / "tokenizers"
    file = folder / f"bpe{vocab_size}-{key}.json"
    if not file.is_file():
        tmp = folder / f".{file.name}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            (folder.parent / CACHEDIR_TAG).write_text(CACHEDIR_SIGNATURE)
        except OSError as error:
            raise unwritable(cache_dir, error) from None
        try:
            sample = bpe_training.sample_pieces(splits["train"], bpe_training.BPE_SAMPLE_BYTES)
            tokenizing.in_child(_train_bpe, sample, vocab_size, tmp)
            tmp.replace(file)  # atomic: a concurrent run that trained the same BPE wrote the same
        finally:
            tmp.unlink(missing_ok=True)
    return HFTokenizer(file.read_text(encoding="utf-8"), spec=spec)


def _train_bpe(pieces: list[tuple[str, int, int]], vocab_size: int, out: Path) -> None:
    """Train the BPE on `pieces` and write its tokenizer.json (in a child process, see `tokenizing.in_child`:
    the trainer's thread pool would otherwise make every later fork of this process warn)."""
    texts: Iterable[str] | Iterable[bytes] = (data.decode("utf-8")
                                              for data in bpe_training.read_pieces(pieces))
    try:
        json_text = bpe_training.train_bpe(texts, vocab_size)
    except UnicodeDecodeError:  # not all UTF-8: train on the bytes as they are (slower)
        json_text = bpe_training.train_bpe(bpe_training.read_pieces(pieces), vocab_size)
    out.write_text(json_text, encoding="utf-8")


def prepared_tokenizer(root: str, spec: str = tokenizers.BYTES) -> Tokenizer:
    """The tokenizer an already tokenized folder was made with (its tokenizer.json; bytes without
    one); one sentence if `spec` names another. An object store's folder is not read here: it is
    taken to hold what `spec` names, which must then be bytes or a tokenizer.json."""
    kind, _ = tokenizers.parse_spec(spec)
    if is_remote(root):
        if kind == "bpe":
            raise ValueError(
                f"data.source {root!r} is already tokenized, and data.tokenizer={spec!r} would train "
                "a BPE on text; give the tokenizer.json the folder was tokenized with instead."
            )
        return Tokenizer() if kind == tokenizers.BYTES else tokenizers.load_file(spec)
    folder = Path(root)
    try:
        meta = json.loads((folder / META).read_text())
    except (OSError, ValueError):
        meta = {}
    if (folder / TOKENIZER).is_file():
        made_with: Tokenizer = HFTokenizer(
            (folder / TOKENIZER).read_text(encoding="utf-8"), meta.get("tokenizer", str(folder / TOKENIZER))
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
