"""The optimizer and the learning-rate schedule of training, defined once: the LightningModule
(`nag_lightning.training.module.LanguageModel.configure_optimizers`) builds its AdamW and its
schedule from here, and so does anything else that trains a `Transformer` of this package.

AdamW (betas (0.9, 0.95) by default) over two parameter groups: the matrices of the sublayers and
the head decay, embeddings, gains, scalars and the residual strategy's own parameters do not
(`parameter_groups`). The learning rate is the peak times `lr_factor`: linear warmup, then cosine
decay to `min_ratio` at the last step ("cosine"), or warmup-stable-decay ("wsd") whose linear
decay fills the last `decay_fraction` of the run's progress (of a FLOP budget when one ends the
run). Gradient clipping is the Trainer's (`trainer.gradient_clip_val`).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor, nn

SCHEDULES = ("cosine", "wsd")


class RunBudget(Protocol):
    """What the learning-rate schedule reads from a budget that ends the run (`FlopBudget`)."""

    @property
    def progress(self) -> float:
        """The fraction of the budget spent so far, 0 to 1."""


def decays(name: str, param: Tensor) -> bool:
    """Whether a parameter (by its name in the model) takes weight decay: the matrices of the
    sublayers and the head do; embeddings, gains and scalars, and the residual strategy's own
    parameters, do not."""
    return param.ndim == 2 and not name.startswith(("embed", "strategy"))


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two groups of `model`'s parameters: those that decay (`decays`), with
    `weight_decay`, then the rest, with none."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (decay if decays(name, param) else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.95), weight_decay: float = 0.1,
          clips_mixed_precision: bool = False) -> torch.optim.AdamW:
    """AdamW over `parameter_groups(model, weight_decay)`, fused where torch takes it
    (`fused_adamw`)."""
    groups = parameter_groups(model, weight_decay)
    params = [p for group in groups for p in group["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas),
                             fused=fused_adamw(params, clips_mixed_precision))


def lr_factor(schedule: str, step: int, warmup: int, total: int, progress: float,
              decay_fraction: float, min_ratio: float) -> float:
    """The learning rate of step `step` (from 0) over the peak: `warmup_cosine` over `total` steps
    for "cosine", `warmup_stable_decay` at `progress` (the fraction of the run done) for "wsd"."""
    if schedule == "cosine":
        return warmup_cosine(step, warmup, total, min_ratio)
    return warmup_stable_decay(step, warmup, progress, decay_fraction, min_ratio)


def fused_adamw(params: list[Tensor], clips_mixed_precision: bool = False) -> bool | None:
    """True where torch's fused AdamW takes these parameters: plain tensors on CPU or CUDA. It
    updates every parameter in one kernel, where the default on CPU loops over them op by op: at
    d_model 256 and 8 blocks on one CPU thread, 11 ms a step against 42 (docs/benchmarks.md,
    "Speed under torch.compile"). FSDP2's sharded parameters (DTensors), other devices, and
    `clips_mixed_precision` (Lightning's mixed-precision plugin refuses to clip gradients for an
    optimizer that unscales them itself, as the fused one does) get the default (None)."""
    from torch.distributed.tensor import DTensor

    if clips_mixed_precision:
        return None
    plain = all(p.device.type in ("cpu", "cuda") and not isinstance(p, DTensor) for p in params)
    return True if plain and params else None


def warmup_stable_decay(
    step: int, warmup: int, progress: float, decay_fraction: float, min_ratio: float
) -> float:
    """Learning-rate factor: linear warmup to 1 over `warmup` steps, then 1 until `progress` (the
    fraction of the run done, 0 to 1) reaches 1 - decay_fraction, then linear decay to min_ratio at
    progress 1 (and min_ratio after)."""
    if step < warmup:
        return (step + 1) / warmup
    start = 1 - decay_fraction
    if progress <= start:
        return 1.0
    return 1 - (1 - min_ratio) * min((progress - start) / decay_fraction, 1.0)


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Learning-rate factor: linear warmup to 1, then cosine decay to min_ratio at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
