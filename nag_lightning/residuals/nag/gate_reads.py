"""Gated angles that read the sublayer's output as well as the token's direction, so the angle
depends on the write and no router can read it before the sublayer runs.

    gate_update:   θ = θ_l · sigmoid(c·<w_l, u> + c·<v_l, f/|f|> + b_l) · g     v_l starting at 0
    gate_tangent:  θ = θ_l · sigmoid(c·<w_l, u> + b_l) · |f⊥|/|f| · g            an update along
                                                                                 the state turns it little
Options as the gate's (`nag_lightning.residuals.nag.gate`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nag_lightning.residuals.nag.bounds import Bound
from nag_lightning.residuals.nag.gate import GateAngle
from nag_lightning.residuals.nag.parts import ANGLES


class _OutputGate(GateAngle):
    """A gate whose angle is known only once the sublayer has written: always the given write."""

    plans = False

    def write(self, u: Tensor, rho: Tensor, f: Tensor, gate: Tensor | None, index: int, alpha: Tensor,
              beta: Tensor, bound: Bound) -> tuple[Tensor, Tensor, Tensor]:
        return self.given_write(u, rho, f, gate, index, alpha, beta, bound)


def _size(f: Tensor) -> Tensor:
    """|f| per token (..., 1) in fp32, never 0."""
    return torch.linalg.vector_norm(f.float(), dim=-1, keepdim=True).clamp_min(1e-12)


@ANGLES.register("gate_update")
class UpdateGateAngle(_OutputGate):
    """The gate reads the direction of the sublayer's output too, with weights v_l of its own."""

    def __init__(self, d_model: int, n_sublayers: int, kernel: str, gate_gain: float | str | None = None,
                 gate_bias: float = 0.0, gate_radial: bool | None = None,
                 angle_cost: float | None = None) -> None:
        super().__init__(d_model, n_sublayers, kernel, gate_gain, gate_bias, gate_radial, angle_cost)
        self.gate_v = nn.Parameter(torch.zeros(n_sublayers, d_model))

    def logit(self, u: Tensor, f: Tensor, index: int) -> Tensor:
        return super().logit(u, f, index) + self.gain * ((f.float() / _size(f)) @ self.gate_v[index].float())


@ANGLES.register("gate_tangent")
class TangentGateAngle(_OutputGate):
    """The gate's share times the sine of the angle between f and u."""

    def share(self, u: Tensor, f: Tensor, index: int) -> Tensor:
        radial = (f.float() * u.float()).sum(-1, keepdim=True) / _size(f)
        return super().share(u, f, index) * (1 - radial.square()).clamp_min(0).sqrt().squeeze(-1)
