"""NAG with rotations in several planes at once: the direction is split into `planes` groups of
channels, each a unit vector of its own (scaled by 1/sqrt(planes), so the whole stays unit norm),
and each write turns every group in its own plane by its own gated angle.

    u = [u_1 | ... | u_P] / sqrt(P),  |u_p| = 1
    θ_p = θmax · sigmoid(√d·<w_l,p, u_p> + b_l,p) · g                 one gate per group
    u_p' = cos θ_p · u_p + sin θ_p · f⊥_p / |f⊥_p|                    f⊥_p ⟂ u_p, within group p
    rho' = rho + mean_p(θ_p / θmax) · β_l · <f, u> / √d

One write of the single-plane NAG turns the whole state, shrinking everything it held by cos θ; here
a write may turn one group (a head's worth of channels) far and leave the others as they were, as
an additive residual writes into a subspace. The contribution is the angle between u and u', acos of
the mean of cos θ_p; a router reads it before the sublayer runs, as the gated NAG's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from nag_kernels import nag_write
from nag_lightning.inputs import shorten
from nag_lightning.residuals import RESIDUALS, State
from nag_lightning.residuals.nag import NAGResidual


@RESIDUALS.register("nag_planes")
class NAGPlanes(NAGResidual):
    """NAG whose direction is `planes` unit groups of channels, each turned by its own gated angle
    within a flat bound.

    Args:
        d_model: width of the residual stream; a multiple of `planes`.
        n_sublayers: number of sublayers that read and write the stream.
        planes: number of channel groups, each rotated in its own plane (e.g. the head count).
        theta_max: bound on each group's angle; None means min(8 / n_sublayers, pi / 2).
        angle_cost: the price on turning, as the gate's (mean over groups of theta_p / theta_max);
            None means the gate's default.
        gate_radial, gate_bias: as the gate's; norm_lane_readout, beta_init, kernel: as NAG's.
    """

    def __init__(
        self,
        d_model: int,
        n_sublayers: int,
        planes: int = 4,
        theta_max: float | None = None,
        angle_cost: float | None = None,
        gate_radial: bool | None = None,
        norm_lane_readout: bool | None = None,
        beta_init: float = 0.0,
        gate_bias: float = 0.0,
        kernel: str = "auto",
    ) -> None:
        if planes < 1 or d_model % planes:
            raise ValueError(f"planes must divide d_model = {d_model}; got {planes}.")
        super().__init__(d_model, n_sublayers, angle="gate", bound="flat", theta_max=theta_max,
                         norm_lane_readout=norm_lane_readout, beta_init=beta_init, kernel=kernel,
                         angle_cost=angle_cost, gate_radial=gate_radial, gate_bias=gate_bias)
        self.planes = planes
        # one bias per group; the gate's weights are already per channel
        self.angle.gate_b = nn.Parameter(torch.full((n_sublayers, planes), float(gate_bias)))

    def _groups(self, x: Tensor) -> Tensor:
        """(..., d) -> (..., P, d / P)."""
        return x.unflatten(-1, (self.planes, self.d_model // self.planes))

    def init_state(self, embedding: Tensor) -> State:
        _, rho = super().init_state(embedding)
        e = self._groups(embedding.float())
        u = e / e.norm(dim=-1, keepdim=True).clamp_min(1e-12) / math.sqrt(self.planes)
        return u.flatten(-2), rho

    def gate_angle(self, u: Tensor, index: int) -> Tensor:
        """Each group's gated angle before any router's gate, (..., P) in fp32."""
        # √d·<w_p, u_p> with u_p of norm 1/√P here: √(d·P) makes it √d times a unit group's
        scale = math.sqrt(self.d_model * self.planes)
        gate_w, gate_b = self.angle.gate_w[index], self.angle.gate_b[index]
        logits = (self._groups(u.float()) * self._groups(gate_w.float())).sum(-1) * scale
        return self.bound.theta_max * torch.sigmoid(logits + gate_b.float())

    def planned_angle(self, state: State, index: int) -> Tensor | None:
        return self._total(self.gate_angle(state[0], index))

    @staticmethod
    def _total(angles: Tensor) -> Tensor:
        """The angle between u and u' of groups turned by `angles` (..., P): acos(mean cos θ_p)."""
        return torch.acos(torch.cos(angles).mean(-1).clamp(-1.0, 1.0))

    def write(
        self, state: State, f: Tensor, gate: Tensor | None, index: int, need_angle: bool = True
    ) -> tuple[State, Tensor | None]:
        u, rho = state
        theta_max, angle = self.bound.theta_max, self.angle
        share = self.gate_angle(u, index) / theta_max  # (..., P)
        if gate is not None:
            share = share * gate.float().unsqueeze(-1)
        groups = self._groups(u) * math.sqrt(self.planes)  # each group unit norm
        u_new, _, theta, _ = nag_write(
            groups, self._groups(f), rho.new_zeros(share.shape), None, self.alpha[index], 0.0,
            theta_max, backend=angle.kernel, angle=theta_max * share,
        )
        radial = share.mean(-1) if angle.gate_radial else (1.0 if gate is None else gate.float())
        a = (f.float() * u.float()).sum(-1)
        rho_new = rho + radial * self.beta[index] * a / math.sqrt(self.d_model)
        if angle.angle_cost and self.training:
            angle.charge(share.mean(-1).sum())
        u_new = (u_new / math.sqrt(self.planes)).flatten(-2).to(u.dtype)
        return (u_new, rho_new), self._total(theta.detach().abs())

    def get_extra_state(self) -> dict:
        return {**super().get_extra_state(), "planes": self.planes}

    def set_extra_state(self, state: object) -> None:
        if isinstance(state, dict) and "planes" in state:
            state = dict(state)
            planes = state.pop("planes")
            if planes != self.planes:  # the groups decide the gate's biases
                raise ValueError(f"The checkpoint was trained with planes={shorten(planes)}; this model was "
                                 f"built with planes={self.planes}: give residual_options "
                                 f"planes={shorten(planes)}.")
        super().set_extra_state(state)
