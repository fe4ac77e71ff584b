"""`NagLightningConfig`: the settings of any of this package's models as a transformers config
(model type "nag_lightning"), for the models a Llama config cannot describe (NAG and the other
residual streams, routed models).

It holds the package's own settings as plain data, read back into the classes of this package
only: `arch` (the `TransformerConfig`: widths, depth, the residual and router names and their
options), `extra_state` (what a plugin saves beside its weights, e.g. NAG's resolved settings)
and `tokenizer_spec` and `tokenizer_key` (which tokenizer the model was trained with). The
standard names other tools read (`vocab_size`, `hidden_size`, `max_position_embeddings`, ...) are
derived from `arch`, never stored beside it, so the two cannot disagree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from transformers import PretrainedConfig

from nag_lightning.checkpoints.trust import untrusted_plugins
from nag_lightning.data.tokenizer import BYTES
from nag_lightning.model import TransformerConfig

MODEL_TYPE = "nag_lightning"
_DEFAULTS = {f.name: f.default for f in fields(TransformerConfig)}


class NagLightningConfig(PretrainedConfig):
    """A model of this package as transformers sees it.

    Args:
        arch: the `TransformerConfig` settings; their residual and router must be registered
            names (or class paths a registry knows), since a folder may come from anyone.
        extra_state: the plugins' saved settings, by state-dict name (`*._extra_state`).
        tokenizer_spec: the tokenizer the model was trained with: "bytes", "bpe:<vocab>" or the
            path of its tokenizer.json (the folder's tokenizer.json holds it in every case).
        tokenizer_key: that tokenizer's identity (`Tokenizer.key`), which the folder's
            tokenizer.json must have.
        kwargs: transformers' own config settings.
    """

    model_type = MODEL_TYPE

    def __init__(
        self,
        arch: Mapping[str, Any] | None = None,
        extra_state: Mapping[str, Mapping] | None = None,
        tokenizer_spec: str = BYTES,
        tokenizer_key: str = BYTES,
        **kwargs: Any,
    ) -> None:
        self.arch = dict(arch or {})
        self.extra_state = {name: dict(value) for name, value in (extra_state or {}).items()}
        self.tokenizer_spec = tokenizer_spec
        self.tokenizer_key = tokenizer_key
        # The package's models keep a head of their own and generate by recomputing the sequence.
        kwargs.update(tie_word_embeddings=False, use_cache=False)
        super().__init__(**kwargs)
        self.transformer_config()  # every setting checked now, in one sentence

    def transformer_config(self) -> TransformerConfig:
        """The architecture as the package's `TransformerConfig`; one sentence (ValueError) for
        settings it refuses or plugins no registry knows."""
        untrusted = untrusted_plugins({"arch": self.arch})
        if untrusted:
            raise ValueError(
                f"The config names code by class path ({', '.join(untrusted)}) that no registry knows, "
                "and a folder may come from anyone; install that plugin with an entry point so that "
                "it is registered."
            )
        try:
            return TransformerConfig(**self.arch)
        except TypeError as error:  # a setting the package does not have
            raise ValueError(
                f"The config's arch holds a setting TransformerConfig does not have ({error}); export "
                "the checkpoint again with `nag-lightning export --format hf`."
            ) from None

    # The standard names tools read, derived from `arch`, the one place they live (read-only).
    def _from_arch(name: str) -> property:
        return property(lambda self: self.arch.get(name, _DEFAULTS[name]))

    vocab_size = _from_arch("vocab_size")
    hidden_size = _from_arch("d_model")
    num_hidden_layers = _from_arch("n_layers")
    num_attention_heads = _from_arch("n_heads")
    max_position_embeddings = _from_arch("seq_len")
    del _from_arch
