"""The tokenizer.json of any of the package's tokenizers, the file an exported folder carries so
that other tools (the `tokenizers` library, transformers) give the package's ids."""

from __future__ import annotations

from nag_lightning.data.tokenizer import HFTokenizer, Tokenizer, _bytes_to_unicode


def tokenizer_json(tokenizer: Tokenizer) -> str:
    """A tokenizer.json for `tokenizer`: a Hugging Face tokenizer's own text, and for bytes a
    byte-level BPE without merges whose id of each byte is its value (GPT-2's byte alphabet)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.json_text
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    hf = _Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return hf.to_str()
