"""A checkpoint's saved model settings, read in the current layout; the one architecture check.

The architecture is one `TransformerConfig`, `model.arch` in YAML and `hyper_parameters["arch"]`
in a checkpoint. Checkpoints (and `hparams.yaml` files) written before it held the same fields flat
among the training settings (`hyper_parameters["d_model"]`, ...), and named a plugin either by a
short name with `<kind>_options` or by a `{class_path, init_args}` mapping. This module is the
only place that knows those layouts: every reader of saved settings goes through
`saved_model_settings` or `saved_architecture`, so the model and the module see one layout. Kept
apart from the model, as checkpoint compatibility should be.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from nag_lightning.model import RESUMABLE_CHANGES, TransformerConfig

ARCH = "arch"
PLUGIN_KINDS = ("residual", "router")


def architecture_fields() -> list[str]:
    """The settings of `TransformerConfig`, in declaration order."""
    return [f.name for f in fields(TransformerConfig)]


def saved_model_settings(saved: Mapping[str, Any]) -> dict[str, Any]:
    """`saved` (a checkpoint's hyperparameters) in the current layout: architecture fields saved
    flat move under `arch` (when there is no `arch`), plugins named by a `{class_path, init_args}`
    mapping become the class path and its options; None for options or route_kinds means their
    defaults."""
    # `init_weights` names a file to read: only the user's own config may, never a saved setting
    settings = {k: v for k, v in saved.items() if k not in architecture_fields() and k != "init_weights"}
    if ARCH in saved:  # the current layout: flat fields beside it are not read (nor built)
        arch = dict(saved[ARCH] or {})
    else:
        arch = {k: v for k, v in saved.items() if k in architecture_fields()}
    for kind in PLUGIN_KINDS:
        spec = arch.get(kind)
        if isinstance(spec, Mapping) and "class_path" in spec:
            arch[kind] = spec["class_path"]
            arch[f"{kind}_options"] = {**dict(spec.get("init_args") or {}),
                                       **dict(arch.get(f"{kind}_options") or {})}
    for key in ("residual_options", "router_options", "route_kinds"):
        if key in arch and arch[key] is None:
            del arch[key]
    if arch:
        settings[ARCH] = arch
    return settings


def saved_architecture(saved: Mapping[str, Any]) -> dict[str, Any]:
    """The `TransformerConfig` settings `saved` holds, in either layout (`saved_model_settings`)."""
    return dict(saved_model_settings(saved).get(ARCH) or {})


def architecture_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """`model.arch.<name>=saved (this run: current)` for every setting the weights depend on (all
    but `RESUMABLE_CHANGES`) that the two architectures give otherwise; a setting `current` does not
    hold yet (vocab_size, before the data module sets it) is left to the check at load time."""
    return [
        f"model.arch.{name}={value!r} (this run: {current[name]!r})"
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


def legacy_settings(model: Mapping[str, Any]) -> list[str]:
    """The keys of a `model` section of a config (or command line) written in the layout before
    `model.arch`, which would otherwise fail without saying why."""
    return [key for key in model if key in architecture_fields()]


def legacy_layout_sentence(where: str, keys: list[str]) -> str:
    """The one sentence that says how an older config maps to the current one."""
    return (
        f"{where} sets {', '.join(f'model.{k}' for k in keys)}, but the architecture settings "
        f"({', '.join(architecture_fields())}) now live under model.arch: write "
        f"model.arch.{keys[0]} for model.{keys[0]}, and a plugin's options in "
        "model.arch.residual_options or model.arch.router_options rather than class_path/init_args "
        "(docs/usage.md, 'Configs written before model.arch')."
    )
