"""The additive angle: a write turns a token as an additive residual turns a state of norm √d,
then the norm is set back.

    k = g·α_l/√d  (inertia "norm" or "lane": k·exp(-rho), the step relative to the state's norm)
    u' = (u + k·f) / |u + k·f|,   θ = atan2(k·|f⊥|, 1 + k·a)

With inertia "norm", rho follows the norm of u + k·f: with α 1 and no norm lane at the readout
this is the pre-norm stream, x = √d·exp(rho)·u, in NAG's lanes. With "lane", rho is NAG's learned
lane (rho + g·β_l·a/√d), so the model sets how much a token resists later turns. θ reaches pi for
an update against the state: the angle takes no bound (theta_max is pi).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from nag_kernels import nag_write
from nag_lightning.residuals.nag.angle import Angle
from nag_lightning.residuals.nag.bounds import Bound
from nag_lightning.residuals.nag.parts import ANGLES, check_choice

INERTIA = ("none", "norm", "lane")


@ANGLES.register("additive")
class AdditiveAngle(Angle):
    """The turn of a renormalised addition.

    Args:
        d_model, n_sublayers, kernel: as `Angle`'s.
        inertia: whether the norm lane slows the step: "none", "norm" (as pre-norm's norm) or
            "lane" (as NAG's learned lane); None: none.
    """

    SETTINGS = ("inertia",)
    ALPHA_INIT = 1.0

    def __init__(self, d_model: int, n_sublayers: int, kernel: str, inertia: str | None = None) -> None:
        super().__init__(d_model, n_sublayers, kernel)
        self.settle({"inertia": inertia}, {"inertia": "none"})

    @staticmethod
    def default_theta_max(n_sublayers: int) -> float:
        return math.pi

    def check(self, settings: dict) -> None:
        check_choice("inertia", settings["inertia"], INERTIA)

    def write(self, u: Tensor, rho: Tensor, f: Tensor, gate: Tensor | None, index: int, alpha: Tensor,
              beta: Tensor, bound: Bound) -> tuple[Tensor, Tensor, Tensor]:
        f32, u32 = f.float(), u.float()
        k = alpha.float() / math.sqrt(self.d_model)
        if gate is not None:
            k = k * gate.float()
        if self.inertia != "none":  # the step relative to the state's norm √d·exp(rho), as pre-norm's
            k = k * torch.exp(-rho.float())
        a = (f32 * u32).sum(-1)
        n = torch.linalg.vector_norm(f32 - a.unsqueeze(-1) * u32, dim=-1)
        angle = torch.atan2(k * n, 1 + k * a)
        if self.inertia == "norm":  # rho follows the norm of u + k f
            u_new, _, theta, _ = nag_write(u, f, rho, gate, alpha, 0.0, bound.theta_max,
                                           backend=self.kernel, angle=angle, pass_elements=self.pass_elements)
            rho_new = rho + 0.5 * torch.log((1 + k * a).square() + (k * n).square())
            return u_new, rho_new.to(rho.dtype), theta
        u_new, rho_new, theta, _ = nag_write(u, f, rho, gate, alpha, beta, bound.theta_max,
                                             backend=self.kernel, angle=angle,
                                             pass_elements=self.pass_elements)
        return u_new, rho_new, theta
