"""FLOPs of any LightningModule, measured on its own training steps.

A module that neither keeps a nag_lightning `Transformer` in `self.model` nor defines
`flop_counter()` is measured: `FlopAccounting` runs the first training step of each batch shape
under `torch.utils.flop_counter.FlopCounterMode` (as Lightning's `measure_flops` does, but on the
real step, so no extra pass runs and nothing the step does is repeated), from the start of the
training step through its backward to just before the optimizer step. Every later batch of that
shape is charged what was measured. Attention counts as math attention whatever kernel ran
(`nag_lightning.model.flops.flop_counter_mode`: the fused kernels' backward is charged the four matrix
products of the math form, not a recomputation of the scores).

A module whose compute depends on the data, not only on the batch's shape (routing, early exit),
is charged its first step of each shape throughout: give it its own `flop_counter()`.

Tokens per batch: the module's `tokens_in_batch(self, batch) -> int` if it has one, else read from
the batch's target part:

    a (B, T + 1) tensor        B x T   (inputs batch[:, :-1], targets batch[:, 1:], this package's layout)
    (inputs, targets) tuple    targets.numel()
    dict                       batch["targets"] or batch["labels"], .numel()
"""

from __future__ import annotations

from collections.abc import Mapping

import lightning as L
import torch
from torch import Tensor, nn

from nag_lightning.model.flops import StepFlops, flop_counter_mode

ShapeKey = tuple[tuple[tuple[int, ...], torch.dtype], ...]


def tensor_leaves(batch: object) -> list[Tensor]:
    """The tensors of a batch of tensors, lists, tuples and dicts, in order."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in tensor_leaves(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in tensor_leaves(value)]
    return []


def target_part(batch: object) -> Tensor | None:
    """The tensor whose positions are the tokens trained on, in the layouts the module docstring
    lists; None for any other batch."""
    if isinstance(batch, Tensor):
        return batch[:, 1:] if batch.ndim == 2 else None
    if isinstance(batch, (list, tuple)) and len(batch) == 2 and isinstance(batch[1], Tensor):
        return batch[1]
    if isinstance(batch, Mapping):
        return next((batch[k] for k in ("targets", "labels") if isinstance(batch.get(k), Tensor)), None)
    return None


class MeasuredFlopCounter:
    """`FlopCounter` of any LightningModule: each batch shape's first training step measured.

    `FlopAccounting` drives it through the batch's hooks (`start`, `forward_done`, `finish`) and
    asks `step()` after the batch, as of any counter.

    Args:
        module: the LightningModule trained.
    """

    def __init__(self, module: L.LightningModule) -> None:
        self.module = module
        self.measured: dict[ShapeKey, tuple[float, float]] = {}  # shape -> (forward, training)
        self.measured_steps = 0  # training steps run under FlopCounterMode
        # The weights a token meets: every parameter but embedding tables (a lookup, no FLOPs).
        tables = {id(m.weight) for m in module.modules() if isinstance(m, nn.Embedding)}
        self.params_per_token = sum(p.numel() for p in module.parameters() if id(p) not in tables)
        self._mode = None
        self._forward: float | None = None
        self._key: ShapeKey | None = None
        self._last: tuple[float, float] | None = None  # (forward, training) of the last batch
        self._tokens = self._samples = 0

    def start(self, batch: object) -> None:
        """At the start of a training batch: read its tokens, and measure it if its shape is new."""
        self.remove()  # a measured batch that never ended (the module skipped it) counts nothing
        leaves = tensor_leaves(batch)
        self._key = tuple((tuple(t.shape), t.dtype) for t in leaves)
        self._tokens = self.tokens(batch)
        self._samples = leaves[0].shape[0] if leaves and leaves[0].ndim else 1
        self._last = self.measured.get(self._key)
        if self._last is None:
            self._forward = None
            self._mode = flop_counter_mode()
            self._mode.__enter__()

    def forward_done(self) -> None:
        """Before the (first) backward: what the mode counted so far is the forward and the loss."""
        if self._mode is not None and self._forward is None:
            self._forward = float(self._mode.get_total_flops())

    def finish(self) -> None:
        """After the backward (before the optimizer step, whose arithmetic is not the model's)."""
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        self.measured_steps += 1
        training = float(mode.get_total_flops())
        if self._forward is None:  # no backward ran (the step returned None): measure again
            self._last = (training, training)
            return
        self._last = self.measured[self._key] = (self._forward, training)

    def tokens(self, batch: object) -> int:
        """Tokens in the batch: the module's `tokens_in_batch(batch)`, else its target part."""
        if hasattr(self.module, "tokens_in_batch"):
            return int(self.module.tokens_in_batch(batch))
        targets = target_part(batch)
        if targets is None:
            raise ValueError(
                f"FlopAccounting cannot tell how many tokens a batch of {type(batch).__name__} "
                f"holds; define `tokens_in_batch(self, batch) -> int` on {type(self.module).__name__}."
            )
        return targets.numel()

    def step(self) -> StepFlops:
        self.finish()  # if a callback asks before FlopAccounting's own end of the batch
        if self._last is None:
            raise RuntimeError("The module has not run a training step yet.")
        forward, training = self._last
        return StepFlops(
            forward=forward, layer=forward, full_depth_layer=forward,
            executed_params=self.params_per_token * self._tokens, tokens=self._tokens,
            samples=self._samples, training=training,
        )

    def remove(self) -> None:
        """Leave FlopCounterMode, discarding the measurement, if a measured step did not end."""
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
