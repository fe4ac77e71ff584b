"""Tokenizers: raw bytes (the default), a Hugging Face `tokenizer.json`, or a byte-level BPE
trained here on the training split of the corpus.

`data.tokenizer` names one:

    bytes          one token per byte, vocabulary 256 (no dependency, no training)
    bpe:<vocab>    a byte-level BPE (GPT-2's pre-tokenizer and byte alphabet, no normalizer) with
                   <vocab> ids, trained offline on the corpus's training split and cached
    <path>         the tokenizer.json of any Hugging Face `tokenizers` tokenizer

Whatever the tokenizer, the data, the metric and generation share one `Tokenizer` object. The
metric stays comparable across tokenizers because it is per byte: every token id knows the bytes it
stands for (`token_bytes`), so a batch's loss summed over its target tokens is divided by the bytes
those tokens cover. A checkpoint keeps its tokenizer as plain data (`saved()`, the tokenizer.json
text), which loads under `torch.load(weights_only=True)`, so generation needs nothing but the
checkpoint.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path

import torch

from nag_lightning.inputs import shorten

BYTES = "bytes"
_BPE = re.compile(r"bpe:(\d+)")
# Ids fit the narrowest dtype litdata stores: chunks of a 4096-id BPE take 2 bytes per token.
_INT16_MAX_VOCAB = 2**15
# The largest BPE the data trains: language models' vocabularies stay below about 256k ids; beyond
# that the embedding and head (vocab x d_model each) outgrow the model, and a corpus of at most
# 64 MiB of training text cannot supply the merges.
MAX_BPE_VOCAB = 2**18
# Bump when the BPE recipe below changes, so cached BPE models are not reused.
BPE_VERSION = 1
# Bump when `HFTokenizer.encode` gives other ids for some input, so chunks it wrote are not reused.
ENCODE_VERSION = 2
# Largest vocabulary accepted: tables of one entry per id (bytes per id, the metric's lengths)
# must stay small whatever id a tokenizer.json names (an id near 2**31 would ask for 16 GB).
MAX_VOCAB = 2**21
_WHITESPACE = b" \t\n\r\x0b\x0c"


class Tokenizer:
    """Raw bytes: token id = byte value, vocabulary 256."""

    spec = BYTES
    vocab_size = 256

    @property
    def key(self) -> str:
        """Identity of the tokenizer: the same key means the same ids for the same text."""
        return BYTES

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    @property
    def dtype(self) -> torch.dtype:
        """The narrowest integer dtype that holds every id, for the litdata chunks."""
        if self.vocab_size <= 256:
            return torch.uint8
        return torch.int16 if self.vocab_size <= _INT16_MAX_VOCAB else torch.int32

    def encode(self, data: bytes) -> torch.Tensor:
        """The token ids of `data`, any bytes (a tokenizer that is not byte-level reads each byte
        that is not UTF-8 as U+FFFD)."""
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def decode(self, ids: Iterable[int]) -> bytes:
        """The bytes `ids` stand for."""
        table = self.token_bytes
        return b"".join(table[i] for i in ids)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for, indexed by id."""
        return [bytes([i]) for i in range(256)]

    @cached_property
    def byte_lengths(self) -> torch.Tensor:
        """How many bytes each id stands for: the denominator of bits per byte."""
        return torch.tensor([len(b) for b in self.token_bytes], dtype=torch.long)

    def saved(self) -> dict:
        """Plain data for a checkpoint (`load_saved` reads it back)."""
        return {"spec": self.spec}

    def describe(self) -> str:
        return f"data.tokenizer={shorten(repr(self.spec))} ({self.vocab_size} ids)"


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` tokenizer, built from its tokenizer.json text."""

    def __init__(self, json_text: str, spec: str) -> None:
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self.hf = _Tokenizer.from_str(json_text)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # a panic of the Rust library included
            raise ValueError(
                f"{shorten(spec)} is not a Hugging Face tokenizer.json ({str(error)[:120]}); give the "
                "tokenizer.json file of a `tokenizers` tokenizer, 'bytes', or 'bpe:<vocab size>'."
            ) from None
        self.json_text = json_text
        self.spec = spec
        ids = self.hf.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise ValueError(
                f"The tokenizer {shorten(spec)} has an empty vocabulary; give a tokenizer.json with tokens."
            )
        self.vocab_size = max(ids) + 1
        if self.vocab_size > MAX_VOCAB:
            raise ValueError(
                f"The tokenizer {shorten(spec)} has a token id of {self.vocab_size - 1}, above the "
                f"{MAX_VOCAB} ids this package handles (its tables have one entry per id); give a "
                "tokenizer.json with a smaller vocabulary."
            )

    def __getstate__(self) -> dict:  # for a child process: the JSON text rebuilds the rest
        return {"json_text": self.json_text, "spec": self.spec}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["json_text"], state["spec"])

    @property
    def key(self) -> str:
        return hashlib.sha256(self.json_text.encode()).hexdigest()[:16]

    def encode(self, data: bytes) -> torch.Tensor:
        # Pieces encode in parallel. Their cuts change no id under a GPT-2-style pre-tokenizer (ours);
        # under others (e.g. SentencePiece's, which marks the start of every input) they may change
        # the ids next to a cut, one in tens of thousands of bytes.
        pieces = split_text(data)
        with self._failures_said("encoding text"):
            try:
                texts = [p.decode("utf-8") for p in pieces]
            except UnicodeDecodeError:  # not UTF-8: text would turn each stray byte into U+FFFD's 3
                if self._by_words is not None:
                    words = [byte_words(self.hf.pre_tokenizer, p) for p in pieces]
                    encoded = self._by_words.encode_batch(
                        words, is_pretokenized=True, add_special_tokens=False
                    )
                    return torch.tensor([i for e in encoded for i in e.ids], dtype=self.dtype)
                texts = [p.decode("utf-8", errors="replace") for p in pieces]
            ids = [i for e in self.hf.encode_batch(texts, add_special_tokens=False) for i in e.ids]
        return torch.tensor(ids, dtype=self.dtype)

    @cached_property
    def _by_words(self):
        """For a byte-level tokenizer without a normalizer, a copy of it that takes the words of
        `byte_words` as they are (no normalizer, no pre-tokenizer), so that any bytes encode
        exactly; None for other tokenizers, which take only text."""
        from tokenizers import Tokenizer as _Tokenizer

        config = json.loads(self.json_text)
        if config.get("normalizer") or "ByteLevel" not in _component_types(config.get("pre_tokenizer")):
            return None
        config["pre_tokenizer"] = None
        return _Tokenizer.from_str(json.dumps(config))

    @cached_property
    def token_bytes(self) -> list[bytes]:
        with self._failures_said("reading its vocabulary"):
            return vocabulary_bytes(self.hf, self.vocab_size)

    @contextmanager
    def _failures_said(self, doing: str) -> Iterator[None]:
        """Any failure of the `tokenizers` library as one sentence: a tokenizer.json (perhaps a
        checkpoint's) can make it fail in ways of its own, Rust panics included, which Python sees
        as `pyo3_runtime.PanicException`, a BaseException."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except BaseException as error:
            if isinstance(error, ValueError) and str(error).startswith("The tokenizer "):
                raise
            reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
            raise ValueError(
                f"The tokenizer {self.spec} failed while {doing} ({reason}); give a tokenizer.json "
                "that the `tokenizers` library runs, e.g. one written by `nag-lightning prepare`."
            ) from None

    def saved(self) -> dict:
        return {"spec": self.spec, "json": self.json_text}


def vocabulary_bytes(hf, vocab_size: int) -> list[bytes]:
    """The bytes each id of a `tokenizers.Tokenizer` stands for.

    Exact for byte-level tokenizers (GPT-2's alphabet, as our BPE uses), for byte-fallback ids
    (`<0xNN>`) and for added tokens (kept verbatim); for other tokenizers it is the UTF-8 of the
    id decoded on its own, with SentencePiece's word marker counted as the space it stands for.
    `coverage` measures how close that comes on real text.
    """
    config = json.loads(hf.to_str())
    decoders = _component_types(config.get("decoder"))
    byte_level = "ByteLevel" in decoders
    added = {t.content for t in hf.get_added_tokens_decoder().values()}
    table = [b""] * vocab_size
    for piece, i in hf.get_vocab(with_added_tokens=True).items():
        if piece in added:
            table[i] = piece.encode()
        elif byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            table[i] = bytes(_UNICODE_TO_BYTE[c] for c in piece)
        elif fallback := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece):
            table[i] = bytes([int(fallback[1], 16)])
        elif "Metaspace" in decoders:
            table[i] = piece.replace("\u2581", " ").encode()
        else:
            table[i] = hf.decode([i], skip_special_tokens=False).encode()
    return table


def _component_types(component: dict | None) -> set[str]:
    """The types of a tokenizer.json component, looking inside a `Sequence`."""
    if not isinstance(component, dict):
        return set()
    inner = component.get("decoders") or component.get("pretokenizers") or []
    return {component.get("type")} | {t for c in inner for t in _component_types(c)}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values onto printable characters."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}
# `str.translate` tables: a Latin-1 character (a byte) to its character in GPT-2's alphabet, and a
# byte that `surrogateescape` kept (U+DC80 + byte, bytes 0x80-0xFF) to U+FFFD.
_LATIN1_TO_ALPHABET = {b: ord(c) for b, c in _bytes_to_unicode().items()}
_ESCAPED_TO_FFFD = dict.fromkeys(range(0xDC80, 0xDD00), 0xFFFD)


def byte_words(pre_tokenizer, data: bytes) -> list[str]:
    """The pre-tokens of any bytes `data`, each written in GPT-2's byte alphabet (one character
    per byte): what a byte-level pre-tokenizer makes of UTF-8 text, and exact for other bytes too.

    The pre-tokenizer takes only text, so it splits `data` read as UTF-8 with each stray byte as
    U+FFFD (one character for one byte, so its character offsets hold); each pre-token is then
    written as the bytes it covers, not as the UTF-8 of U+FFFD.
    """
    text = data.decode("utf-8", errors="surrogateescape")
    spans = pre_tokenizer.pre_tokenize_str(text.translate(_ESCAPED_TO_FFFD))
    return [
        text[start:end].encode("utf-8", errors="surrogateescape").decode("latin-1").translate(
            _LATIN1_TO_ALPHABET)
        for _, (start, end) in spans
    ]


def split_text(data: bytes, target: int = 1 << 16) -> list[bytes]:
    """`data` cut into pieces of about `target` bytes, only before a newline that follows a
    non-whitespace byte: the GPT-2 pre-tokenizer ends a pre-token there anyway (and a whitespace
    run that starts with the newline sees the same text after it), so encoding the pieces gives
    the same ids as encoding the whole, and a UTF-8 character is never cut."""
    pieces, start = [], 0
    while len(data) - start > target:
        cut = safe_cut(data, start + target)
        if cut <= start:
            match = _CUT.search(data, start + target)
            cut = match.start() + 1 if match else len(data)
        pieces.append(data[start:cut])
        start = cut
    pieces.append(data[start:])
    return [p for p in pieces if p]


_CUT = re.compile(rb"[^ \t\n\r\x0b\x0c]\n")


def safe_cut(data: bytes, end: int | None = None) -> int:
    """The last position <= `end` of a newline that follows a non-whitespace byte (where
    `split_text` may cut); 0 if there is none."""
    i = data.rfind(b"\n", 0, len(data) if end is None else end + 1)
    while i > 0:
        if data[i - 1] not in _WHITESPACE:
            return i
        i = data.rfind(b"\n", 0, i)
    return 0


def parse_spec(spec: str) -> tuple[str, int | None]:
    """("bytes", None), ("bpe", vocab size) or ("file", None) for a `data.tokenizer` value."""
    if spec == BYTES:
        return BYTES, None
    if spec.startswith("bpe"):
        match = _BPE.fullmatch(spec)
        if not match or int(match[1]) <= 256:
            raise ValueError(
                f"data.tokenizer={spec!r} is not a BPE the data can train; write 'bpe:<vocab size>' "
                "with a vocabulary above the 256 byte values, e.g. 'bpe:4096'."
            )
        if int(match[1]) > MAX_BPE_VOCAB:
            raise ValueError(
                f"data.tokenizer={spec!r} asks for more token ids than the largest BPE the data "
                f"trains ({MAX_BPE_VOCAB:,}): an embedding and head that large dwarf the model, and "
                "the training text cannot fill it; use e.g. 'bpe:4096' (or up to 'bpe:65536')."
            )
        return "bpe", int(match[1])
    return "file", None


def load_file(path: str) -> HFTokenizer:
    """A Hugging Face tokenizer from its tokenizer.json."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"data.tokenizer={path!r} is neither 'bytes', 'bpe:<vocab size>' nor an existing "
            "tokenizer.json file; give one of these."
        )
    return HFTokenizer(file.read_text(encoding="utf-8"), spec=str(file))


def load_saved(saved: object, vocab_size: int | None = None, source: str = "") -> Tokenizer:
    """The tokenizer a checkpoint (at `source`) keeps (`Tokenizer.saved()`); bytes for checkpoints
    without one. It is untrusted input: with the model's `vocab_size`, every id must be below it."""
    tokenizer = _load_saved(saved)
    if vocab_size is not None:
        check_fits(tokenizer, vocab_size, source)
    return tokenizer


def check_fits(tokenizer: Tokenizer, vocab_size: int, source: str = "") -> None:
    """One sentence unless every id of a checkpoint's (at `source`) `tokenizer` is below the model's
    `vocab_size`: the model embeds the ids the tokenizer gives."""
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"The checkpoint {source + ' ' if source else ''}holds a tokenizer with ids up to "
            f"{tokenizer.vocab_size - 1}, beyond the model's vocabulary of {vocab_size} ids; give "
            "a checkpoint written by `nag-lightning fit`, whose tokenizer fits its model."
        )


def _load_saved(saved: object) -> Tokenizer:
    if saved is None:
        return Tokenizer()
    if not isinstance(saved, dict) or not isinstance(saved.get("spec"), str):
        raise ValueError(
            "The checkpoint's tokenizer entry is not one nag-lightning writes; give a checkpoint "
            "written by `nag-lightning fit`."
        )
    if saved["spec"] == BYTES:
        return Tokenizer()
    if not isinstance(saved.get("json"), str):
        raise ValueError(
            f"The checkpoint names the tokenizer {shorten(repr(saved['spec']))} but does not hold it; give a "
            "checkpoint written by `nag-lightning fit`."
        )
    return HFTokenizer(saved["json"], saved["spec"])


class StreamDecoder:
    """Decodes token ids one at a time into text, holding back the bytes of an unfinished UTF-8
    character until the ids that complete it arrive (a BPE id may end inside a character)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """The text that `token` completes (possibly empty)."""
        return self._utf8.decode(self.tokenizer.token_bytes[token])

    def flush(self) -> str:
        """What is left, invalid bytes replaced."""
        return self._utf8.decode(b"", final=True)
