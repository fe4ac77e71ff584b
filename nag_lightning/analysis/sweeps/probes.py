"""Routers fitted to a frozen model: how a model trained without routing gets routers to sweep.

Each router the model has may offer a router to put in its place (`Sweepable.for_sweep`; the
unrouted `none` offers a threshold router, whose probe predicts the contribution angle). Only the new
routers' parameters learn, from their own auxiliary loss; the model's weights stay as trained.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nag_lightning.analysis.sweeps.sweepable import sweep_of
from nag_lightning.model import Transformer
from nag_lightning.routers import Router


def attach_sweep_routers(model: Transformer, route_kinds: list[str], fit_steps: int,
                         options: dict | None = None) -> list[Router]:
    """Put in place of the router of every sublayer of `route_kinds` the router it offers for a
    sweep (`Sweepable.for_sweep`, given `options` when there are any), which runs every token for its
    first `fit_steps` training forwards; returns the routers attached."""
    device = next(model.parameters()).device
    attached = []
    for s in model.sublayers:
        if s.kind not in route_kinds:
            continue
        adapter = sweep_of(type(s.router))
        if adapter is None:
            continue
        replacement = adapter.replacement(s.router, fit_steps, **(options or {}))
        if replacement is not None:
            s.router = replacement.to(device)
            attached.append(s.router)
    model.check_routers()
    return attached


def fit_probes(model: Transformer, routers: list[Router], batches: list[Tensor], lr: float) -> list[float]:
    """Train only `routers`' parameters on `batches` through the model's auxiliary loss, the model
    frozen; returns the mean auxiliary loss per router of each batch."""
    model.requires_grad_(False).eval()
    params = [p for r in routers for p in r.parameters()]
    if not params:
        raise ValueError("The routers to fit have no parameters to learn; nothing to fit.")
    for p in params:
        p.requires_grad_(True)
    for r in routers:
        r.train()
    optimizer = torch.optim.Adam(params, lr=lr)
    device = params[0].device
    losses = []
    for batch in batches:
        out = model(batch[:, :-1].to(device))
        optimizer.zero_grad()
        out.aux_loss.backward()
        optimizer.step()
        losses.append(out.aux_loss.item() / len(routers))
    model.requires_grad_(False).eval()
    return losses
