"""The sweep's oracle: skip a sublayer wherever its *measured* contribution angle is below tau.

The angle is known only after the sublayer ran, so the oracle saves no compute: it shows how well a
predictor of the angle could do at the same MoD rate. It is installed for an evaluation only
(`with oracle(model, tau):`), in place of the routed sublayers, and asks no router; the model
itself knows nothing of it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nag_lightning.model import Sublayer, Transformer
from nag_lightning.model.kv_cache import CachedPass
from nag_lightning.model.transformer import merge
from nag_lightning.residuals import ResidualStrategy, State


class OracleSublayer(Sublayer):
    """A sublayer that runs every token and keeps the write where the angle it turned the token by
    reaches `tau` radians. It shares the compute and router of the sublayer it stands in for, and
    records what `Sublayer` records, so FLOP counts and diagnostics read it alike. Generation
    (`cached`) routes by the router as usual.

    Args:
        sublayer: the sublayer it stands in for.
        tau: the angle threshold in radians.
    """

    def __init__(self, sublayer: Sublayer, tau: float) -> None:
        super().__init__(sublayer.kind, sublayer.index, sublayer.compute, sublayer.router)
        self.tau = tau
        self.record = sublayer.record

    def forward(self, state: State, strategy: ResidualStrategy, cached: CachedPass | None = None) -> State:
        if cached is not None:
            return super().forward(state, strategy, cached)
        h = strategy.read(state, self.index).to(self.compute.proj.weight.dtype)
        written, angle = strategy.write(state, self.compute(h), None, self.index, True)
        keep = angle >= self.tau  # (B, T)
        self.executed_per_seq = keep.sum(1)
        if self.record:
            self.contribution, self.executed = torch.where(keep, angle, 0.0), keep
            planned = strategy.planned_angle(state, self.index)
            self.planned_angle = None if planned is None else planned.detach()
        return self.merge(state, written, keep)

    def merge(self, state: State, written: State, keep: torch.Tensor) -> State:
        """The state after the write: each lane written where `keep` (B, T), as it was elsewhere
        (a subclass may keep some lanes' writes everywhere)."""
        return merge(state, written, keep)


@contextmanager
def oracle(model: Transformer, tau: float, every_sublayer: bool = False,
           kind: type[OracleSublayer] = OracleSublayer) -> Iterator[None]:
    """Inside the block, the routed sublayers of `model` (all of them with `every_sublayer`) are
    oracles (`kind`) at `tau` radians; on leaving it, the model is as it was."""
    replaced = [(block, name, getattr(block, name)) for block in model.blocks for name in ("attn", "mlp")]
    try:
        for block, name, sublayer in replaced:
            if every_sublayer or sublayer.routed:
                setattr(block, name, kind(sublayer, tau))
        yield
    finally:
        for block, name, sublayer in replaced:
            setattr(block, name, sublayer)


def under_oracle(model: Transformer) -> bool:
    """Whether `oracle` has replaced sublayers of `model`: then no router decides."""
    return any(isinstance(s, OracleSublayer) for s in model.sublayers)
