"""A byte-level BPE trained on the corpus, and how well a tokenizer covers the corpus's bytes: the
BPE's training text sampled evenly over the training split (`sample_pieces`, `read_pieces`), its
training (`train_bpe`), and the coverage measured on the head of the split (`read_head`,
`coverage`). `bpe` (the corpus's tokenizer) and `tokenizing` (the chunks) call these.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator

from nag_lightning.data.tokenizer import Tokenizer, byte_words

# The BPE is trained on at most this many bytes of the training split, taken as evenly spaced
# files so that every part of the corpus is represented. The default corpus (the standard library,
# 30 MB of training text) fits whole: a 2048-id BPE trained on all of it in 4.5 s on 2 CPU cores
# (on a 6.9 MB sample in 1.1 s, with 0.8% fewer bytes per token on the validation split). The cap
# bounds the time and memory of training on a larger corpus.
BPE_SAMPLE_BYTES = 64 * 2**20
# Corpus bytes that `coverage` compares with the bytes its tokens stand for.
COVERAGE_SAMPLE_BYTES = 2**20


def train_bpe(texts: Iterable[str] | Iterable[bytes], vocab_size: int) -> str:
    """Train a byte-level BPE of `vocab_size` ids on `texts`; return its tokenizer.json text.

    GPT-2's recipe, as nanochat and most byte-level BPEs follow it: no normalizer, the GPT-2 regex
    pre-tokenizer over its byte alphabet (all 256 byte values are ids, so any text encodes, and
    every id stands for definite bytes), merges learned until `vocab_size` ids, no special tokens.
    `texts` given as bytes need not be UTF-8: they train on the words `encode` makes of them
    (`byte_words`, split here in Python, so slower than text).
    """
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = _Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
    )
    texts = iter(texts)
    first = next(texts, "")
    if isinstance(first, bytes):
        # GPT-2's alphabet holds no whitespace, so words joined by spaces split back exactly.
        hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        words = (" ".join(byte_words(byte_level, t)) for t in itertools.chain([first], texts))
        hf.train_from_iterator(words, trainer=trainer)
    else:
        hf.pre_tokenizer = byte_level
        hf.train_from_iterator(itertools.chain([first], texts), trainer=trainer)
    hf.pre_tokenizer = byte_level
    return hf.to_str()


def sample_pieces(pieces: list[tuple[str, int, int]], limit: int) -> list[tuple[str, int, int]]:
    """At most `limit` bytes of `pieces` (path, start, end): every k-th piece, k chosen so that
    they hold about `limit` bytes, spread over the whole corpus; the last one possibly cut."""
    total = sum(end - start for _, start, end in pieces)
    every = -(-total // limit)  # ceil
    kept, room = [], limit
    for path, start, end in pieces[::every]:
        if room <= 0:
            break
        kept.append((path, start, min(end, start + room)))
        room -= kept[-1][2] - start
    return kept


def read_pieces(pieces: Iterable[tuple[str, int, int]]) -> Iterator[bytes]:
    """The bytes of each (path, start, end)."""
    for path, start, end in pieces:
        with open(path, "rb") as f:
            f.seek(start)
            yield f.read(end - start)


def read_head(pieces: Iterable[tuple[str, int, int]], limit: int) -> bytes:
    """The first `limit` bytes of the concatenated pieces."""
    head, room = [], limit
    for path, start, end in pieces:
        if room <= 0:
            break
        head += read_pieces([(path, start, min(end, start + room))])
        room -= len(head[-1])
    return b"".join(head)


def coverage(tokenizer: Tokenizer, data: bytes) -> dict[str, float]:
    """How many bytes the tokens of `data` stand for, against `data`'s own length: equal for a
    lossless tokenizer whose ids have definite bytes, so bits per byte is exact."""
    ids = tokenizer.encode(data)
    lengths = tokenizer.byte_lengths
    return {"bytes": len(data), "tokens": len(ids), "token_bytes": int(lengths[ids.long()].sum())}
