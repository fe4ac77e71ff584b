"""A trained `Transformer` out of a `nag-lightning fit` checkpoint, without Lightning.

Commands that only run the model (`generate`) load it here: importing Lightning takes seconds,
which a command that starts, writes a line and ends should not pay. The checkpoint is untrusted
input: it is read with `weights_only=True`, and the residual strategy and router it names must be
registered names (a class path in a checkpoint would import any module).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import torch

from nag_lightning.model import SUBLAYER_KINDS, Transformer, TransformerConfig
from nag_lightning.residuals import RESIDUALS
from nag_lightning.routers import ROUTERS


def load_transformer(ckpt_path: str, device: str = "cpu") -> tuple[Transformer, dict]:
    """The checkpoint's model, in eval mode on `device`, and its saved hyperparameters."""
    if not Path(ckpt_path).is_file():
        raise FileNotFoundError(
            f"The checkpoint {ckpt_path} does not exist; give the path of a .ckpt file written by "
            "`nag-lightning fit` (e.g. <run dir>/checkpoints/last.ckpt)."
        )
    checkpoint = torch.load(ckpt_path, map_location=device, weights_only=True)
    saved = checkpoint.get("hyper_parameters")
    if not isinstance(saved, dict) or "state_dict" not in checkpoint:
        raise ValueError(
            f"{ckpt_path} is not a checkpoint of `nag-lightning fit` (no hyper_parameters or "
            "state_dict); give a .ckpt file from a run's checkpoints/ folder."
        )
    for key, registry in (("residual", RESIDUALS), ("router", ROUTERS)):
        name = saved.get(key)
        if name is not None and (not isinstance(name, str) or name not in registry.names()):
            raise ValueError(
                f"The checkpoint names its {registry.kind} {name!r}, which is not a registered "
                f"name ({', '.join(registry.names())}); install the package that registers it."
            )
    names = {f.name for f in fields(TransformerConfig)}
    options = {k: v for k, v in saved.items() if k in names}
    for key in ("residual_options", "router_options"):
        options[key] = dict(options.get(key) or {})
    options["route_kinds"] = list(options.get("route_kinds") or SUBLAYER_KINDS)
    model = Transformer(TransformerConfig(**options))
    prefix = "model."
    weights = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    model.load_state_dict(weights)
    return model.to(device).eval(), saved
