"""The values a checkpoint holds, checked as it is read: finite weights, and plugin settings that
their plugin's own rules accept.

`fit` never writes a non-finite checkpoint (`nag_lightning.callbacks.run_checkpoint`), so a weight
that is NaN or infinite means a damaged or crafted file; used silently, it generates NUL bytes and
reports a bits per byte of nan. The settings a plugin saves in the state dict (its
`_extra_state`, e.g. NAG's theta_max and bound) are checked by loading them into the model the
checkpoint describes, built on the meta device, so the plugin applies the rules its constructor
applies (`NAGResidual.set_extra_state`) before anything is allocated or run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nag_lightning.inputs import shorten

EXTRA_STATE = "_extra_state"


def check_finite(state_dict: Mapping[str, Any], source: str) -> None:
    """One sentence naming the first floating-point tensor of `state_dict` (a checkpoint's, at
    `source`) that holds a NaN or an infinity."""
    for name, value in state_dict.items():
        if torch.is_tensor(value) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            raise ValueError(
                f"The checkpoint {shorten(source)} holds a weight {shorten(name)} that is not finite "
                "(NaN or infinite), which `nag-lightning fit` never writes; give an undamaged "
                "checkpoint, e.g. an earlier one of the same run."
            )


def check_saved_settings(model: nn.Module, weights: Mapping[str, Any], source: str) -> None:
    """One sentence if a plugin of `model` (built on the meta device from the checkpoint's settings)
    refuses the settings it saved in `weights` (the checkpoint's, at `source`)."""
    for name, value in weights.items():
        if not name.endswith(EXTRA_STATE):
            continue
        try:
            model.load_state_dict({name: value}, strict=False)
        except ValueError as error:
            raise ValueError(
                f"The checkpoint {shorten(source)} holds saved settings {shorten(name)} that its "
                f"model refuses ({str(error).rstrip('.')}); give an undamaged checkpoint written by "
                "`nag-lightning fit`."
            ) from None
