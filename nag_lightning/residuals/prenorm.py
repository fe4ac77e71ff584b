"""Pre-norm residual stream: the baseline NAG is measured against.

Every sublayer reads an RMS-normalized copy of the stream and adds its output back:

    x ──┬──────────────────────────(+)──> x' = x + g·f
        └─> RMSNorm ─> ·γ_l ─> F_l ─> f ┘

Nothing bounds ||x||, so it grows with depth, and a later sublayer's update turns the state by an
ever smaller angle: the suppression of later layers that arXiv 2606.16112 (Figliolia & Millidge,
"Scaling Adaptive Depth with Norm-Agnostic Residual Networks") sets out to remove.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nag_lightning.residuals import RESIDUALS, ResidualStrategy, State, radial_split


@RESIDUALS.register("prenorm")
class PreNormResidual(ResidualStrategy):
    """x' = x + g·f, read through RMSNorm with a per-sublayer gain, a final RMSNorm before the head.

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers that read and write the stream.
        eps: RMSNorm epsilon.
    """

    def __init__(self, d_model: int, n_sublayers: int, eps: float = 1e-6) -> None:
        super().__init__(d_model, n_sublayers)
        self.eps = eps
        self.gamma = nn.Parameter(torch.ones(n_sublayers, d_model))
        self.gamma_out = nn.Parameter(torch.ones(d_model))

    def init_state(self, embedding: Tensor) -> State:
        return (embedding,)

    def read(self, state: State, index: int) -> Tensor:
        (x,) = state
        return F.rms_norm(x, (self.d_model,), self.gamma[index], self.eps)

    def write(
        self, state: State, f: Tensor, gate: Tensor | None, index: int, need_angle: bool = True
    ) -> tuple[State, Tensor | None]:
        (x,) = state
        update = f if gate is None else gate.unsqueeze(-1).to(f.dtype) * f
        if not need_angle:
            return (x + update.to(x.dtype),), None
        x_norm = x.float().norm(dim=-1)
        # Angle between x and x + update: atan2(|update_perp|, |x| + update_par).
        a, update_perp = radial_split(update.float(), x.float() / x_norm.clamp_min(1e-12).unsqueeze(-1))
        angle = torch.atan2(update_perp.norm(dim=-1), x_norm + a)
        return (x + update.to(x.dtype),), angle.detach()

    def final(self, state: State) -> tuple[Tensor, Tensor | None]:
        (x,) = state
        return F.rms_norm(x, (self.d_model,), self.gamma_out, self.eps), None

    def state_norm(self, state: State) -> Tensor:
        (x,) = state
        return x.float().norm(dim=-1) / self.d_model**0.5
