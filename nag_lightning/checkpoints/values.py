"""The values a checkpoint holds, checked as it is read: finite weights, plugin settings that
their plugin's own rules accept, and the Lightning release it names.

`fit` never writes a non-finite checkpoint (`nag_lightning.callbacks.run_checkpoint`), so a weight
that is NaN or infinite means a damaged or crafted file; used silently, it generates NUL bytes and
reports a bits per byte of nan. The settings a plugin saves in the state dict (its
`_extra_state`, e.g. NAG's theta_max and bound) are checked by loading them into the model the
checkpoint describes, built on the meta device, so the plugin applies the rules its constructor
applies (`NAGResidual.set_extra_state`) before anything is allocated or run. Lightning upgrades
a checkpoint by the release it says wrote it, and fails with a KeyError on one that names a release
older than any this package ran on, so such a name is refused as the file is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nag_lightning.inputs import shorten

EXTRA_STATE = "_extra_state"
LIGHTNING_VERSION = "pytorch-lightning_version"
OLDEST_LIGHTNING = "2.0.0"
"""The oldest Lightning release a checkpoint of `nag-lightning fit` may name: the package has
always required a 2.x release, and Lightning converts checkpoints of older ones by their layout."""


def check_lightning_version(raw: Mapping[str, Any], source: str) -> None:
    """One sentence if `raw` (a checkpoint, at `source`) names a Lightning release that is not a
    version number or is older than OLDEST_LIGHTNING (a checkpoint without the entry is let be)."""
    from packaging.version import InvalidVersion, Version

    if LIGHTNING_VERSION not in raw:
        return
    named = raw[LIGHTNING_VERSION]
    try:
        old = Version(named) < Version(OLDEST_LIGHTNING)
    except (InvalidVersion, TypeError):
        old = True
    if old:
        raise ValueError(
            f"The checkpoint {shorten(source)} says Lightning {shorten(repr(named))} wrote it, which "
            f"no checkpoint of `nag-lightning fit` says (it runs on Lightning {OLDEST_LIGHTNING} or "
            "later); give a checkpoint written by `nag-lightning fit`."
        )


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
