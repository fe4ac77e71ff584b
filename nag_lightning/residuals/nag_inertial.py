"""NAG with inertia: the norm lane is the stream's norm, and slows the token's later turns.

A formulation family of NAG (docs/design.md, section 2). Its state is NAG's two lanes, a unit
direction u and a log-norm rho, and each write turns u in the plane of its update; what changes is
where the angle comes from. Here it is the turn Peri-LN's stream makes (arXiv 2502.02732): the
update is RMS-normalized with its own gain, f̂ = RMSNorm(f)·γ_post,l, and added to a stream of norm
√d·exp(rho):

    u ──┬─> √d·u·γ_l ─> F_l ─> f ─> s = g·f̂/√d, k = exp(-rho), a = <s,u>, s⊥ = s - a·u
        ├─> θ = atan2(k·|s⊥|, 1 + k·a)
        └───────────────────────────────> u' = cos θ · u + sin θ · s⊥/|s⊥|
    rho ──────────────────────────────────> rho' = rho + ½·log((1 + k·a)² + (k·|s⊥|)²)

so x = √d·exp(rho)·u is Peri-LN's stream exactly, written in NAG's lanes. The diagnosis on the
task (docs/results_tasks.md) found this the one thing NAG's gated write lacks: a write along the
state turns nothing but makes the token heavier, so what earlier blocks wrote resists later turns
token by token (removing it from Peri-LN cost 18 points at 4 blocks). The readout is NAG's: the
norm lane scales the logits, exp(clamp(rho, -4, 4)), as a per-token confidence; without it
(`norm_lane_readout: false`) the model computes Peri-LN's logits, a test holds it to them.
`tangential: true` drops the update's part along u (a = 0): the norm grows only by the turn.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nag_lightning.residuals import RESIDUALS, State
from nag_lightning.residuals.nag.lanes import DirectionAndNormLanes


@RESIDUALS.register("nag_inertial")
class InertialNAGResidual(DirectionAndNormLanes):
    """NAG's lanes turned by Peri-LN's additive geometry, the norm lane read out as confidence.

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers that read and write the stream.
        norm_lane_readout: multiply the logits by exp(clamp(rho, -4, 4)), as NAG does; off, the
            model is Peri-LN.
        tangential: drop the update's part along the direction, so a write only turns.
        eps: RMSNorm epsilon of the embedding and update norms.
    """

    def __init__(self, d_model: int, n_sublayers: int, norm_lane_readout: bool = True,
                 tangential: bool = False, eps: float = 1e-6) -> None:
        super().__init__(d_model, n_sublayers)
        for name, value in (("norm_lane_readout", norm_lane_readout), ("tangential", tangential)):
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false; got {str(value)[:40]}.")
        self.norm_lane_readout, self.tangential, self.eps = norm_lane_readout, tangential, eps
        # Peri-LN's gains under Peri-LN's names, so its checkpoints' residual weights load here
        self.gamma = nn.Parameter(torch.ones(n_sublayers, d_model))
        self.gamma_post = nn.Parameter(torch.ones(n_sublayers, d_model))
        self.gamma_embed = nn.Parameter(torch.ones(d_model))
        self.gamma_out = nn.Parameter(torch.ones(d_model))

    def init_state(self, embedding: Tensor) -> State:
        return self.lanes_of(F.rms_norm(embedding.float(), (self.d_model,), self.gamma_embed, self.eps))

    def write(
        self, state: State, f: Tensor, gate: Tensor | None, index: int, need_angle: bool = True
    ) -> tuple[State, Tensor | None]:
        u, rho = state
        s = F.rms_norm(f.float(), (self.d_model,), self.gamma_post[index], self.eps) / math.sqrt(self.d_model)
        k = torch.exp(-rho)  # the step relative to the stream's norm: a heavy token turns less
        if gate is not None:
            k = k * gate.float()
        a = (s * u).sum(-1)
        perp = s - a.unsqueeze(-1) * u
        n = torch.linalg.vector_norm(perp, dim=-1)
        if self.tangential:
            a = torch.zeros_like(a)
        along, across = 1 + k * a, k * n
        theta = torch.atan2(across, along)
        # no turn where the update has no tangential part (theta is then 0): the division is safe
        direction = perp / n.clamp_min(1e-12).unsqueeze(-1)
        u_new = torch.cos(theta).unsqueeze(-1) * u + torch.sin(theta).unsqueeze(-1) * direction
        # exactly rho where the gate is 0: log(1 + 0) is 0
        rho_new = rho + 0.5 * torch.log((along.square() + across.square()).clamp_min(1e-30))
        return (u_new, rho_new), theta.detach()
