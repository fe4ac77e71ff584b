"""The tokenizer of a Hugging Face folder: written so that `AutoTokenizer` gives the package's
token ids for the same text, and read back into the package's `Tokenizer`.

    tokenizer.json          the package's tokenizer as a `tokenizers` file (`tokenizer_json`): a
                            BPE's own file, and for bytes a byte-level vocabulary of 256 whose id of
                            each byte is its value
    tokenizer_config.json   `PreTrainedTokenizerFast` over that file, with no special tokens added
                            and no clean-up of spaces on decoding, so text and ids map exactly as
                            in the package

No class is named by module path and no file holds code: transformers builds its own fast
tokenizer from tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from nag_lightning.checkpoints.exported import TOKENIZER
from nag_lightning.data.tokenizer import BYTES, HFTokenizer, Tokenizer, check_fits
from nag_lightning.data.tokenizer_json import tokenizer_json
from nag_lightning.inputs import shorten

TOKENIZER_CONFIG = "tokenizer_config.json"


def write_tokenizer(tokenizer: Tokenizer, folder: Path, seq_len: int) -> None:
    """tokenizer.json and tokenizer_config.json of `tokenizer` into `folder`, for a model that
    reads at most `seq_len` tokens."""
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": seq_len,
        "clean_up_tokenization_spaces": False,  # decoding gives the bytes the ids stand for
        "add_bos_token": False,
        "add_eos_token": False,
    }
    (folder / TOKENIZER).write_text(tokenizer_json(tokenizer), encoding="utf-8")
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(settings, indent=2), encoding="utf-8")


def read_tokenizer(
    folder: Path, vocab_size: int, source: str, spec: str | None = None, key: str | None = None
) -> Tokenizer:
    """The tokenizer of the folder `source` (at `folder`) as the package's: the bytes tokenizer
    where tokenizer.json stands for bytes, else its `tokenizers` tokenizer. `spec` and `key`
    (`Tokenizer.key`) are those the model was trained with, where the folder says (None: a Llama
    folder does not). One sentence (FileNotFoundError, ValueError) where the file is missing or
    unreadable, or does not match the model: another tokenizer than the model's, ids beyond its
    vocabulary of `vocab_size`, or fewer ids than it predicts (they could not be decoded)."""
    file = folder / TOKENIZER
    if not file.is_file():
        raise FileNotFoundError(
            f"The folder {source} holds no {TOKENIZER}, which the package needs to turn text into the "
            "model's ids; give a folder written by `nag-lightning export --format hf`, or add the "
            "model's tokenizer.json."
        )
    found = HFTokenizer(file.read_text(encoding="utf-8", errors="replace"), str(file))
    is_bytes = found.vocab_size == 256 and found.token_bytes == Tokenizer().token_bytes
    if spec == BYTES and not is_bytes:
        raise ValueError(
            f"The {TOKENIZER} of {source} does not stand for bytes, which its model was trained on "
            "(tokenizer_spec: bytes); give the folder's own tokenizer, or export it again."
        )
    tokenizer = Tokenizer() if is_bytes else found
    if key is not None and tokenizer.key != key:
        raise ValueError(
            f"The {TOKENIZER} of {source} is not the tokenizer its model was trained with (its "
            f"config names {shorten(spec or key)}); give the folder's own tokenizer.json, or export it again."
        )
    check_fits(tokenizer, vocab_size, source)
    if vocab_size > tokenizer.vocab_size:
        raise ValueError(
            f"The {TOKENIZER} of {source} has {tokenizer.vocab_size} ids and its model predicts "
            f"{vocab_size}, which this tokenizer cannot decode; give the model's own tokenizer."
        )
    return tokenizer
