"""torch.compile for the Transformer, in place, with recompilation bounded for routed models.

`compile_model` uses `nn.Module.compile`, which compiles the module's call without wrapping it:
parameter names, the state dict and checkpoints stay as they are (`torch.compile(model)` would
prefix every key with `_orig_mod.`). The LightningModule calls it from `configure_model` when
`model.compile` is set, so the Trainer compiles the model on its device, after the strategy has
set it up.

Unrouted models compile to one graph. Routed ones break the graph where the executed tokens are
gathered (`nonzero`, whose output shape depends on the routing) and where routed attention reads
the padded width (`int(...)`), and the sublayer code resumed after such a break is shared by every
sublayer: dynamo would specialise it on each sublayer's `index` and on routers' Python-int step
counters, and recompile per layer and per step until it hits its recompile limit and silently runs
eagerly. `allow_unspec_int_on_nn_module` makes such integer attributes dynamic after they first
change, as dynamo already does for sizes (the executed count N), so recompilations stop after the
first few steps whatever the depth (docs/kernels.md, "torch.compile", has the counts).
"""

from __future__ import annotations

import torch
from torch import nn


def compile_model(model: nn.Module, **options: object) -> nn.Module:
    """Compile `model` in place (options go to torch.compile, e.g. backend, mode) and return it."""
    # Process-wide, and harmless to everything else: an int attribute of a module that changes is
    # traced as a symbol (one recompile) instead of being baked in (a recompile per value).
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    model.compile(**options)
    return model
