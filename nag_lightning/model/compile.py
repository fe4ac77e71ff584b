"""torch.compile for the Transformer, in place, with recompilation bounded for routed models.

`compile_model` uses `nn.Module.compile`, which compiles the module's call without wrapping it:
parameter names, the state dict and checkpoints stay as they are (`torch.compile(model)` would
prefix every key with `_orig_mod.`). The LightningModule calls it from `configure_model` when
`model.compile` is set, so the Trainer compiles the model on its device, after the strategy has
set it up.

Unrouted models compile to one graph, and so do routed ones: top-k gathers the same number of
tokens from every sequence at positions it returns (static shapes), and the threshold router's
data-dependent sizes (the executed tokens' `nonzero`, the padded width of routed attention) are
traced as symbols (`capture_dynamic_output_shape_ops`, `capture_scalar_outputs`) instead of
breaking the graph. Routers' Python-int step counters would still specialise the graph on each
value; `allow_unspec_int_on_nn_module` makes such integer attributes dynamic after they first
change, so recompilations stop after the first few steps whatever the depth (docs/benchmarks.md,
"Speed under torch.compile", has the counts).
"""

from __future__ import annotations

import torch
from torch import nn

from nag_lightning.routers import Router


def compile_model(model: nn.Module, **options: object) -> nn.Module:
    """Compile `model` in place (options go to torch.compile, e.g. backend, mode) and return it."""
    # Process-wide, and harmless to everything else: an int attribute of a module that changes is
    # traced as a symbol (one recompile) instead of being baked in (a recompile per value).
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # Routing reads data-dependent sizes: the executed tokens' `nonzero` and the padded width of
    # routed attention. Traced as symbols, they stay inside the graph instead of breaking it.
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    torch._dynamo.config.capture_scalar_outputs = True
    for module in model.modules():
        if isinstance(module, Router):
            # In one graph, a router's state update in `observe` would write buffers that the
            # compiled backward saved (the forward read them): apply it at the next forward's
            # start or after backward (`Transformer.apply_router_updates`), as under checkpointing.
            module.defer_updates = True
    model.compile(**options)
    return model
