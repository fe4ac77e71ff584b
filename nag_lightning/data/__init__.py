"""Language-modelling data: text -> litdata token chunks -> streaming batches.

Text is tokenized ONCE, in `prepare_corpus`, into litdata chunks under `cache_dir/<hash>/{train,val}`:
by default as raw bytes (vocab 256, one token per byte), or with the tokenizer `data.tokenizer`
names (`nag_lightning.data.tokenizer`: a Hugging Face tokenizer.json, or a byte-level BPE trained here on
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

The package, by job: `corpus` (which files, their splits, the cache key), `tokenizing` (litdata's
`optimize` in a child process), `tokenizer` (bytes, BPE and Hugging Face tokenizers), `bpe` (the
corpus's tokenizer), `prepare` (the cache folder, written atomically), `orphans` (what an
interrupted preparation leaves behind), `filesystem` (probes and the sentences for folders that
fail) and `datamodule` (the LightningDataModule). The names below are the public ones, importable
from `nag_lightning.data`; each loads on first use, so a tokenizer (`generate`) costs no Lightning
or litdata import.
"""

_PUBLIC = {
    "load_tokenizer": "bpe", "prepared_tokenizer": "bpe",
    "DEFAULT_STDLIB_MAX_BYTES": "corpus", "check_source": "corpus", "optimized_dir": "corpus",
    "resolve_files": "corpus", "stdlib_files": "corpus", "token_counts": "corpus",
    "TextDataModule": "datamodule",
    "ByteDataModule": "datamodule",  # the name of earlier releases, kept for their configs
    "prepare_corpus": "prepare",
}


def __getattr__(name: str):
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(f"nag_lightning.data.{_PUBLIC[name]}"), name)
    raise AttributeError(f"module 'nag_lightning.data' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])


__all__ = sorted(_PUBLIC)
