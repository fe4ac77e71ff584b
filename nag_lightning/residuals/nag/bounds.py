"""How far sublayer l may turn a token: the bound of NAG's angle, by depth.

Turns toward a direction many tokens share add up over depth, so the bound falls like 1/depth
(theta_max = 8/N for the gate, at most pi/2): with pi/2 every token collapses onto one direction
within a few blocks (docs/design.md, "Measured since").

    flat:      theta_l = theta_max
    decaying:  theta_l = min(theta_max * sqrt(N / (H_N (l + 1))), pi/2)    sum of theta_l^2 as flat's
    learned:   theta_l = pi * sigmoid(s_l),  s_l starting where theta_l = theta_max
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from nag_lightning.inputs import shorten
from nag_lightning.residuals.nag.parts import BOUNDS, Part, number


class Bound(Part):
    """A bound on the angle of each sublayer's write.

    Args:
        n_sublayers: number of sublayers that write the stream.
        theta_max: the bound's scale in radians, in (0, pi]; None means `default_theta_max`.
        default_theta_max: theta_max when none is given (the angle's own default).
    """

    SETTINGS = ("theta_max",)
    fixed = True
    """Whether `of` is a number known before training (the fused gated write takes only those)."""

    def __init__(self, n_sublayers: int, theta_max: float | None, default_theta_max: float) -> None:
        super().__init__()
        self.n_sublayers = n_sublayers
        self.settle({"theta_max": theta_max}, {"theta_max": default_theta_max})

    def check(self, settings: dict) -> None:
        theta_max = settings["theta_max"]
        if not number(theta_max) or not 0 < theta_max <= math.pi:
            raise ValueError(f"theta_max must be in (0, pi] radians; got {shorten(repr(theta_max))}.")

    def of(self, index: int) -> float | Tensor:
        """The bound on sublayer `index`'s angle, in radians."""
        raise NotImplementedError


@BOUNDS.register("flat")
class FlatBound(Bound):
    """theta_max at every sublayer."""

    def of(self, index: int) -> float:
        return self.theta_max


@BOUNDS.register("decaying")
class DecayingBound(Bound):
    """theta_max * sqrt(c / (l + 1)), c = N / H_N, at most pi / 2: the squared bounds sum as flat
    ones do, and early writes may turn further than later ones, as the l-th of equal-sized additive
    writes turns a pre-norm or Peri-LN stream by atan(1 / sqrt(l))."""

    def of(self, index: int) -> float:
        harmonic = sum(1 / (i + 1) for i in range(self.n_sublayers))
        return min(self.theta_max * math.sqrt(self.n_sublayers / harmonic / (index + 1)), math.pi / 2)


@BOUNDS.register("learned")
class LearnedBound(Bound):
    """pi * sigmoid(s_l), one learned s_l per sublayer, starting where the bound is theta_max."""

    fixed = False

    def __init__(self, n_sublayers: int, theta_max: float | None, default_theta_max: float) -> None:
        super().__init__(n_sublayers, theta_max, default_theta_max)
        start = math.log(self.theta_max / (math.pi - self.theta_max)) if self.theta_max < math.pi else 4.0
        self.logit = nn.Parameter(torch.full((n_sublayers,), start))

    def of(self, index: int) -> Tensor:
        return math.pi * torch.sigmoid(self.logit[index])
