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

The package, by job: `corpus` (which files, their splits, the cache key), `tokenizing` (litdata's
`optimize` in a child process), `bpe` (the corpus's tokenizer), `prepare` (the cache folder, written
atomically), `filesystem` (probes and the sentences for folders that fail) and `datamodule` (the
LightningDataModule). The names below are the public ones, importable from `nag_lightning.data`.
"""

from nag_lightning.data.bpe import load_tokenizer, prepared_tokenizer
from nag_lightning.data.corpus import (
    DEFAULT_STDLIB_MAX_BYTES,
    check_source,
    optimized_dir,
    resolve_files,
    stdlib_files,
    token_counts,
)
from nag_lightning.data.datamodule import ByteDataModule, TextDataModule
from nag_lightning.data.prepare import prepare_corpus

__all__ = [
    "DEFAULT_STDLIB_MAX_BYTES", "ByteDataModule", "TextDataModule", "check_source", "load_tokenizer",
    "optimized_dir", "prepare_corpus", "prepared_tokenizer", "resolve_files", "stdlib_files",
    "token_counts",
]
