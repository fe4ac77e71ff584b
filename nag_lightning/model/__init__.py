"""The network and what runs it: plain `torch.nn`, single device, no Lightning.

`config` (the architecture's settings), `attention`, `sublayer` (the MLP, the sublayer wrapper
and the block) and `transformer` (the model that puts them together), `kv_cache` and `inference` (generation),
`compile` (`torch.compile` for training), `flops` (the model's own FLOP count) and `routing_stats`
(what the routers executed). The model's names are importable from `nag_lightning.model`.
"""

from nag_lightning.model.transformer import (
    RESUMABLE_CHANGES,
    SUBLAYER_KINDS,
    SUBLAYER_MODULES,
    Attention,
    Block,
    Rotary,
    Sublayer,
    SwiGLU,
    Transformer,
    TransformerConfig,
    TransformerOutput,
)

__all__ = [
    "RESUMABLE_CHANGES", "SUBLAYER_KINDS", "SUBLAYER_MODULES", "Attention", "Block", "Rotary", "Sublayer",
    "SwiGLU", "Transformer", "TransformerConfig", "TransformerOutput",
]
