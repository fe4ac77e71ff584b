"""`prepare_corpus`: a corpus tokenized once into `cache_dir/<hash>/{train,val}`, written to a
temporary folder and renamed into place, so an interrupted run never leaves a cache that looks
complete."""

from __future__ import annotations

import inspect
import json
import shutil
import warnings
from pathlib import Path

from nag_lightning.arguments import flags_named, function_parser
from nag_lightning.data import corpus, tokenizing
from nag_lightning.data import tokenizer as tokenizers
from nag_lightning.data.bpe import corpus_tokenizer, prepared_tokenizer
from nag_lightning.data.filesystem import CACHEDIR_SIGNATURE, CACHEDIR_TAG, is_remote, unwritable
from nag_lightning.data.orphans import owned_name, remove_orphaned
from nag_lightning.data.tokenizer import Tokenizer


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
    complete. An already optimized `source` (see `corpus.optimized_dir`) is returned unchanged (a URI stays
    a string). With `seq_len`, each split must hold at least one sequence of `seq_len + 1` bytes.
    `tokenizer` is "bytes", "bpe:<vocab size>" (trained on the training split, cached under
    `cache_dir/tokenizers/`) or the path of a Hugging Face tokenizer.json.
    """
    corpus.check_fraction(val_fraction)
    source = corpus.local_uris(source)
    if (ready := corpus.optimized_dir(source)) is not None:
        prepared_tokenizer(ready, tokenizer)  # refuses a tokenizer the folder was not made with
        return ready if is_remote(ready) else Path(ready)
    files, splits, sizes, max_bytes = corpus.plan(source, val_fraction, max_bytes, seq_len)
    tok = corpus_tokenizer(tokenizer, files, splits, val_fraction, max_bytes, cache_dir)
    key = None if tok.key == tokenizers.BYTES else f"{tok.key}-{tokenizers.ENCODE_VERSION}"
    target = Path(cache_dir).expanduser().resolve() / corpus.corpus_hash(files, val_fraction, max_bytes, key)
    if (target / corpus.META).is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        (target.parent / CACHEDIR_TAG).write_text(CACHEDIR_SIGNATURE)
        remove_orphaned(target.parent)  # what killed runs left; live runs' folders stay
        tmp = target.parent / owned_name(target.name)
        tmp.mkdir()
    except OSError as error:
        raise unwritable(cache_dir, error) from None
    try:
        if key is None:
            tokenizing.in_child(tokenizing.tokenize, splits, tmp)
        else:
            tokenizing.in_child(tokenizing.tokenize_with, tok, splits, tmp)
            (tmp / corpus.TOKENIZER).write_text(tok.json_text, encoding="utf-8")
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
        (tmp / corpus.META).write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(target)
        except OSError:  # another process finished the same cache first: keep theirs
            if not (target / corpus.META).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _coverage(folder: Path, tokenizer: Tokenizer) -> dict[str, float]:
    """The bytes a sample's tokens stand for against its own (written by `tokenizing.tokenize_with`), and a
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


def prepare_command(args: list[str]) -> None:
    """`nag-lightning prepare`: tokenize a corpus into litdata chunks ahead of training."""
    parser = function_parser(prepare_corpus, "nag-lightning prepare", prepare_command.__doc__)
    cfg = parser.parse_args(args)
    with flags_named(inspect.signature(prepare_corpus).parameters):
        path = prepare_corpus(**cfg.as_dict())
    print(f"prepared {path}")
