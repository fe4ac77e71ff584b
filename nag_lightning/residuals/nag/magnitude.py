"""The magnitude angle: a write turns a token by the bounded size of the sublayer's tangential
output.

    θ = θ_l · s(g·α_l·|f⊥| / (√d·θ_l)),   s = tanh, or x / (1 + |x|) ("rational")

Adam grows |f⊥| until nearly every token sits on the bound, so θ then says little about which
tokens matter (docs/design.md, "Measured since"). The write runs as `nag_kernels.nag_write`.
"""

from __future__ import annotations

from torch import Tensor

from nag_kernels import BOUNDS as SATURATIONS
from nag_kernels import nag_write
from nag_lightning.residuals.nag.angle import Angle
from nag_lightning.residuals.nag.bounds import Bound
from nag_lightning.residuals.nag.parts import ANGLES, check_choice


@ANGLES.register("magnitude")
class MagnitudeAngle(Angle):
    """The bounded size of the sublayer's tangential output.

    Args:
        d_model, n_sublayers, kernel: as `Angle`'s.
        saturation: how θ approaches the bound: "tanh" (exponentially) or "rational"
            (x / (1 + |x| / θ_l), whose gradient decays only like 1/x^2); None: tanh.
    """

    SETTINGS = ("saturation",)

    def __init__(self, d_model: int, n_sublayers: int, kernel: str, saturation: str | None = None) -> None:
        super().__init__(d_model, n_sublayers, kernel)
        self.settle({"saturation": saturation}, {"saturation": "tanh"})

    def check(self, settings: dict) -> None:
        check_choice("saturation", settings["saturation"], SATURATIONS)

    def write(self, u: Tensor, rho: Tensor, f: Tensor, gate: Tensor | None, index: int, alpha: Tensor,
              beta: Tensor, bound: Bound) -> tuple[Tensor, Tensor, Tensor]:
        u_new, rho_new, theta, _ = nag_write(u, f, rho, gate, alpha, beta, bound.of(index),
                                             backend=self.kernel, bound=self.saturation,
                                             pass_elements=self.pass_elements)
        return u_new, rho_new, theta
