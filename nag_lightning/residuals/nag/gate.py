"""The gated angle, NAG's default: a learned gate on the token's own direction chooses the share of
the bound a write turns it by.

    θ = θ_l · sigmoid(c·<w_l, u> + b_l) · g          θ_l the bound, c = gate_gain, g the router's gate

The gate is known before the sublayer runs, so a router may skip on it without a predictor, and
it cannot be pushed to the bound by scaling the sublayer's output. The write with a fixed bound runs
fused (`nag_kernels.gated_nag_write`); under a learned bound the angle is computed here and given
to `nag_kernels.nag_write`.

Its options: `gate_gain` (c, a number or "sqrt_d"; 1 makes the gate learn sqrt(d) times slower
than sqrt_d, where an Adam step on w_l moves its logit by about 0.8·d·lr), `gate_bias` (b_l's
start; 0 turns every token by half the bound), `gate_radial` (the radial update follows the gate:
g·β_l·a/√d becomes (θ/θ_l)·β_l·a/√d), and `angle_cost` (a price on turning: angle_cost times the
mean of θ/θ_l over sublayers and tokens joins the training loss).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from nag_kernels import gated_angle, gated_nag_write, nag_write
from nag_lightning.inputs import shorten
from nag_lightning.residuals.nag.angle import Angle
from nag_lightning.residuals.nag.bounds import Bound
from nag_lightning.residuals.nag.parts import ANGLES, check_flag, number


@ANGLES.register("gate")
class GateAngle(Angle):
    """The angle as a gated share of the bound, from the token's direction.

    Args:
        d_model, n_sublayers, kernel: as `Angle`'s.
        gate_gain: the scale c of the gate's dot product, a positive number or "sqrt_d"; None: 1.
        gate_bias: the initial b_l of every sublayer.
        gate_radial: scale the radial update by the gate's share of the bound instead of by the
            router's gate; None: off.
        angle_cost: weight of the training loss on the mean share of the bound turned; None: 0.
            A value given wins over a checkpoint's, to go on training under another price.
    """

    SETTINGS = ("gate_gain", "gate_radial", "angle_cost")
    OBJECTIVE = ("angle_cost",)
    DEFAULT_BOUND = "decaying"
    BOUNDS = None
    plans = True

    def __init__(self, d_model: int, n_sublayers: int, kernel: str, gate_gain: float | str | None = None,
                 gate_bias: float = 0.0, gate_radial: bool | None = None,
                 angle_cost: float | None = None) -> None:
        super().__init__(d_model, n_sublayers, kernel)
        self.settle({"gate_gain": gate_gain, "gate_radial": gate_radial, "angle_cost": angle_cost},
                    {"gate_gain": 1.0, "gate_radial": False, "angle_cost": 0.0})
        self.gate_w = nn.Parameter(torch.zeros(n_sublayers, d_model))
        self.gate_b = nn.Parameter(torch.full((n_sublayers,), float(gate_bias)))
        # this training pass's sum of θ/θ_l over writes and tokens (None: nothing priced yet) and
        # its number of tokens: a routed write sees only its executed tokens, a skipped one turns
        # by 0. A tensor, not a list: a list's length would be guarded under torch.compile.
        self._turned: Tensor | None = None
        self._tokens = 0

    @staticmethod
    def default_theta_max(n_sublayers: int) -> float:
        """8/N, at most a right angle (in a model of one or two blocks 8/N would exceed it)."""
        return min(8.0 / n_sublayers, math.pi / 2)

    def check(self, settings: dict) -> None:
        gain = settings["gate_gain"]
        if gain != "sqrt_d" and not (number(gain) and gain > 0):
            raise ValueError(f"gate_gain must be a positive number or sqrt_d; got {shorten(repr(gain))}.")
        check_flag("gate_radial", settings["gate_radial"])
        cost = settings["angle_cost"]
        if not (number(cost) and cost >= 0):
            raise ValueError(f"angle_cost must be a number >= 0; got {shorten(repr(cost))}.")

    @property
    def gain(self) -> float:
        """The scale of the gate's dot products: gate_gain, "sqrt_d" meaning sqrt(d_model)."""
        return math.sqrt(self.d_model) if self.gate_gain == "sqrt_d" else float(self.gate_gain)

    def write(self, u: Tensor, rho: Tensor, f: Tensor, gate: Tensor | None, index: int, alpha: Tensor,
              beta: Tensor, bound: Bound) -> tuple[Tensor, Tensor, Tensor]:
        if not bound.fixed:
            return self.given_write(u, rho, f, gate, index, alpha, beta, bound)
        limit = bound.of(index)
        u_new, rho_new, theta, angle = gated_nag_write(
            u, f, rho, gate, alpha, beta, limit, self.gate_w[index], self.gate_b[index], self.gain,
            radial=self.gate_radial, backend=self.kernel, pass_elements=self.pass_elements,
        )  # fmt: skip
        if self.angle_cost and self.training:
            self.charge(angle.sum() / limit)
        return u_new, rho_new, theta

    def given_write(self, u: Tensor, rho: Tensor, f: Tensor, gate: Tensor | None, index: int,
                    alpha: Tensor, beta: Tensor, bound: Bound) -> tuple[Tensor, Tensor, Tensor]:
        """The write with the angle computed here (`share`) and given to `nag_write`."""
        limit = bound.of(index)
        share = self.share(u, f, index)
        if gate is not None:
            share = share * gate.float()
        # with a given angle the write's gate scales only the radial update
        u_new, rho_new, theta, _ = nag_write(
            u, f, rho, share if self.gate_radial else gate, alpha, beta, bound.theta_max,
            backend=self.kernel, angle=limit * share, pass_elements=self.pass_elements,
        )
        if self.angle_cost and self.training:
            self.charge(share.sum())
        return u_new, rho_new, theta

    def logit(self, u: Tensor, f: Tensor, index: int) -> Tensor:
        """The gate's logit per token (...), in fp32."""
        return self.gain * (u.float() @ self.gate_w[index].float()) + self.gate_b[index].float()

    def share(self, u: Tensor, f: Tensor, index: int) -> Tensor:
        """The share of the bound each token turns by before the router's gate (...), in fp32."""
        return torch.sigmoid(self.logit(u, f, index))

    def state_angle(self, u: Tensor, index: int, bound: Bound) -> Tensor:
        """The gate's angle of every token from its direction alone (...), in fp32."""
        return gated_angle(u, self.gate_w[index], self.gate_b[index], bound.of(index), self.gain)

    def planned(self, u: Tensor, index: int, bound: Bound) -> Tensor | None:
        return self.state_angle(u, index, bound) if self.plans else None

    def charge(self, turned: Tensor) -> None:
        """Add a write's sum of θ/θ_l over its tokens to this pass's price."""
        self._turned = turned if self._turned is None else self._turned + turned

    def start(self, tokens: int) -> None:
        super().start(tokens)
        self._turned, self._tokens = None, tokens

    def aux_loss(self) -> Tensor | None:
        """angle_cost times the mean share of the bound the last training pass turned by."""
        if self._turned is None:
            return None
        return self.angle_cost * self._turned / (self.n_sublayers * self._tokens)
