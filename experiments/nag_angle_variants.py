"""NAG variants probed while looking for an informative angle (docs/results.md, "Init and the
angle"). Plugins outside the package, named by dotted path, e.g.

    PYTHONPATH=experiments OMP_NUM_THREADS=1 nag-lightning fit --config recipes/study/depth.yaml \
        --model.arch.n_layers=8 --seed_everything=1 --model.arch.init_std=0.125 --model.lr=1.2e-2 \
        --model.arch.residual=nag_angle_variants.GatedNAG

- `GatedNAG` (now the package's default angle of `nag`, with a bound of 8/N there): the angle is a
  learned per-token gate, theta = theta_max * sigmoid(sqrt(d) <w_l, u> + b_l) (times the router's
  g), and the sublayer only supplies the direction f_perp / |f_perp|. The angle is known before the
  sublayer runs, from the token's own state, so a token whose angle is small can skip it without a
  separate predictor; and the size of f no longer feeds the angle, so Adam cannot push every token
  to the bound by growing the sublayer's output.
- `RelativeNAG`: theta = theta_max * tanh(alpha * sqrt(N) * c * n / ema(n)): the update's size
  relative to the sublayer's running mean, so scaling a sublayer up cannot saturate every token.

Both turn u through `nag_kernels.nag_write` with the angle given.
"""

from __future__ import annotations

import math

import torch

from nag_kernels import nag_write
from nag_lightning.residuals.nag import NAGResidual


class GatedNAG(NAGResidual):
    """`NAGResidual(angle="gate")` as probed, with the magnitude angle's 4/N bound unless theta_max
    is given (the packaged option defaults to 8/N, the better of the two measured), unpriced and
    with the radial update free of the gate unless angle_cost and gate_radial are given (the
    packaged defaults price it; docs/results.md, section 0).

    Args:
        gate_bias: initial b_l (0: every token starts at theta_max / 2).
        (the rest as NAGResidual; alpha is unused)
    """

    def __init__(self, d_model: int, n_sublayers: int, theta_max: float | None = None, **kwargs) -> None:
        theta_max = 4.0 / n_sublayers if theta_max is None else theta_max
        kwargs = {"angle_cost": 0.0, "gate_radial": False, **kwargs}
        super().__init__(d_model, n_sublayers, theta_max=theta_max, angle="gate", **kwargs)


class RelativeNAG(NAGResidual):
    """theta = theta_max * tanh(alpha * sqrt(N) * rel_scale * n / ema(n)).

    Args:
        rel_scale: the unbounded angle, in units of theta_max, of an update of average size.
        momentum: weight of each training batch in the running mean of n.
        (the rest as NAGResidual)
    """

    def __init__(self, *args, rel_scale: float = 0.5, momentum: float = 0.01, **kwargs) -> None:
        # its own angle replaces the magnitude one (bound 4/N as probed); it has no gate
        super().__init__(*args, angle="magnitude", **kwargs)
        self.rel_scale = rel_scale
        self.momentum = momentum
        self.register_buffer("n_ema", torch.zeros(self.n_sublayers))

    def write(self, state, f, gate, index, need_angle=True):
        u, rho = state
        u32, f32 = u.float(), f.float()
        a = (f32 * u32).sum(-1)
        n = torch.linalg.vector_norm(f32 - a[..., None] * u32, dim=-1)
        if self.training:
            with torch.no_grad():
                mean, ema = n.mean(), self.n_ema[index]
                moved = (1 - self.momentum) * ema + self.momentum * mean
                self.n_ema[index] = torch.where(ema == 0, mean, moved)
        g = 1.0 if gate is None else gate.float()
        relative = n / self.n_ema[index].clamp_min(1e-6)
        x = g * self.alpha[index] * math.sqrt(self.n_sublayers) * self.rel_scale * relative
        theta = self.bound.theta_max * torch.tanh(x)
        u_new, rho_new, theta, _ = nag_write(
            u, f, rho, gate, self.alpha[index], self.beta[index], self.bound.theta_max,
            backend=self.angle.kernel, angle=theta,
        )  # fmt: skip
        return (u_new, rho_new), theta.detach().abs()
