"""A checkpoint's saved model settings, read in the current layout; the one architecture check.

The architecture is one `TransformerConfig`, `model.arch` in YAML and `hyper_parameters["arch"]`
in a checkpoint. Earlier layouts are brought to this one by `nag_lightning.checkpoints.compat`, which every
reader of saved settings goes through (`saved_model_settings`, `saved_architecture`), so the model
and the module see one layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nag_lightning.checkpoints.compat import ARCH, current_layout
from nag_lightning.inputs import shorten
from nag_lightning.model import RESUMABLE_CHANGES


def saved_model_settings(saved: Mapping[str, Any]) -> dict[str, Any]:
    """`saved` (a checkpoint's or an hparams.yaml's hyperparameters) in the current layout."""
    settings = current_layout(saved)
    # `init_weights` names a file to read: only the user's own config may, never a saved setting
    settings.pop("init_weights", None)
    return settings


def saved_architecture(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The `TransformerConfig` settings `saved` holds, in either layout (`saved_model_settings`)."""
    return dict(saved_model_settings(saved).get(ARCH) or {})


def architecture_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`model.arch.<name>=saved (this run: current)` for every setting the weights depend on (all
    but `RESUMABLE_CHANGES`) that the two architectures give otherwise; a setting `current` does not
    hold yet (vocab_size, before the data module sets it) is left to the check at load time."""
    return [
        f"model.arch.{name}={shorten(repr(value))} (this run: {shorten(repr(current[name]))})"
        for name, value in saved.items()
        if name in current and name not in RESUMABLE_CHANGES and _plain(value) != _plain(current[name])
    ]


def check_architecture(saved: Mapping[str, Any], current: Mapping[str, Any], source: str = "") -> None:
    """One sentence if a checkpoint (at `source`), whose hyperparameters are `saved`, was trained
    with an architecture whose weights differ from `current` (a `TransformerConfig`'s settings).
    The command line asks before it builds anything; the module whenever it loads a checkpoint."""
    differences = architecture_differences(saved_architecture(saved), current)
    if differences:
        raise ValueError(
            f"The checkpoint {source + ' ' if source else ''}was trained with a different architecture: "
            + ", ".join(differences)
            + "; resume with the same model settings (e.g. the run's config.yaml) or start a new "
            "run without ckpt_path."
        )


def _plain(value: object) -> object:
    """YAML-loaded and Python values alike: tuples as lists."""
    return list(value) if isinstance(value, tuple) else value
