"""NAG's two lanes, shared by every residual that keeps them: a unit direction u and a log-norm
rho. A strategy built on them chooses only how a write turns u and moves rho; how the lanes start,
how a sublayer reads them and how the head reads them out are the same."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from nag_lightning.residuals import ResidualStrategy, State


class DirectionAndNormLanes(ResidualStrategy):
    """The lanes' start, read and readout.

    Subclasses implement `write` and set `norm_lane_readout`, the read gains `gamma` (n_sublayers,
    d) and the head's gain `gamma_out` (d,): each creates them in the order of its own parameters,
    which is the order of the optimizer's state in its checkpoints.
    """

    norm_lane_readout: bool
    gamma: nn.Parameter
    gamma_out: nn.Parameter

    def lanes_of(self, e: Tensor) -> State:
        """(u, rho) of a stream x = √d·exp(rho)·u equal to `e` (..., d), in fp32."""
        e = e.float()
        norm = e.norm(dim=-1).clamp_min(1e-12)
        return e / norm.unsqueeze(-1), torch.log(norm / math.sqrt(self.d_model))

    def read(self, state: State, index: int) -> Tensor:
        u, _ = state
        # the constant goes on the (d,) gain, not the (B, T, d) state: one full-size multiply, not two
        return u * (math.sqrt(self.d_model) * self.gamma[index])

    def final(self, state: State) -> tuple[Tensor, Tensor | None]:
        """The head reads √d·u·γ_out; the norm lane, when read out, scales the logits by
        exp(clamp(rho, -4, 4)), a per-token inverse temperature."""
        u, rho = state
        features = u * (math.sqrt(self.d_model) * self.gamma_out)
        if not self.norm_lane_readout:
            return features, None
        return features, torch.exp(rho.clamp(-4.0, 4.0)).unsqueeze(-1)

    def state_norm(self, state: State) -> Tensor:
        _, rho = state
        return torch.exp(rho)
