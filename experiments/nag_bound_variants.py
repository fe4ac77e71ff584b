"""Two NAG variants tried while looking for a better angle bound (docs/results.md), kept so the
numbers there can be rerun. They are plugins outside the package, named by dotted path:

    PYTHONPATH=experiments OMP_NUM_THREADS=1 nag-lightning study depth --depths '[16]' --seeds '[1]' \
        --residuals '[nag]' --out runs/probe/atan \
        --extra '["--model.arch.residual=nag_bound_variants.AtanBoundNAG",
                  "--model.arch.residual_options={theta_max: 0.125, norm_lane_readout: true}"]'

- `AtanBoundNAG`: theta = theta_max * (2/pi) * atan((pi/2) x / theta_max). Slope 1 at 0 like
  tanh, but its gradient decays like 1/x^2 instead of exponentially. It tied with tanh; the
  package's `saturation="rational"` has the same tail and a kernel.
- `LearnedBoundNAG`: a learnable bound per sublayer, theta_max * exp(scale * s_l), s_l from 0.
  In 400 steps the bounds moved by less than 0.2 in log and the loss did not improve.

Both run the write in plain PyTorch (no kernel): they are for small CPU probes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from nag_lightning.residuals import State
from nag_lightning.residuals.nag import NAGResidual


def rotate(state: State, f: Tensor, gate: Tensor | None, alpha: Tensor, beta: Tensor, bound) -> tuple:
    """The NAG write of DESIGN section 2 with theta = bound(g alpha n / sqrt(d))."""
    u, rho = state
    d = u.shape[-1]
    u32, f32 = u.float(), f.float()
    g = 1.0 if gate is None else gate.float()
    k = g * alpha.float() / math.sqrt(d)
    a = (f32 * u32).sum(-1)
    f_perp = f32 - a[..., None] * u32
    n = torch.linalg.vector_norm(f_perp, dim=-1)
    theta = bound(k * n)
    small = n <= 1e-6
    s = torch.where(small, k * torch.ones_like(n), torch.sin(theta) / torch.where(small, 1.0, n))
    raw = torch.cos(theta)[..., None] * u32 + s[..., None] * f_perp
    u_new = raw / torch.linalg.vector_norm(raw, dim=-1, keepdim=True)
    rho_new = rho.float() + g * beta.float() * a / math.sqrt(d)
    return (u_new.to(u.dtype), rho_new.to(rho.dtype)), theta.detach().abs()


class MagnitudeNAG(NAGResidual):
    """NAG with the magnitude angle (theta from |f_perp|), the formulation these variants bound
    differently; it has no gate."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, angle="magnitude", **kwargs)


class AtanBoundNAG(MagnitudeNAG):
    """NAG with an arctangent bound on the angle."""

    def write(self, state, f, gate, index, need_angle=True):
        scale = math.pi / 2 / self.bound.theta_max
        return rotate(state, f, gate, self.alpha[index], self.beta[index],
                      lambda x: torch.atan(scale * x) / scale)


class LearnedBoundNAG(MagnitudeNAG):
    """NAG whose bound is learned per sublayer: theta_max * exp(bound_scale * s_l), s_l from 0.

    Args:
        bound_scale: multiplies the learned log-bound, i.e. its effective learning rate.
        (the rest as NAGResidual)
    """

    def __init__(self, *args, bound_scale: float = 1.0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log_bound = nn.Parameter(torch.zeros(self.n_sublayers))
        self.bound_scale = bound_scale

    def write(self, state, f, gate, index, need_angle=True):
        limit = self.bound.theta_max * torch.exp(self.bound_scale * self.log_bound[index])
        return rotate(state, f, gate, self.alpha[index], self.beta[index],
                      lambda x: limit * torch.tanh(x / limit))
