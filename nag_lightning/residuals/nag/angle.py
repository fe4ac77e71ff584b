"""What every NAG angle does: turn a token's direction u toward the tangential part of a
sublayer's output f by an angle it chooses, within its sublayer's bound, and move the log-norm rho
by the radial part.

    a = <f, u>, f⊥ = f - a·u
    u' = cos θ · u + sin θ · f⊥/|f⊥|          θ: the angle's choice, at most the bound
    rho' = rho + g·β_l·a/√d
"""

from __future__ import annotations

import torch
from torch import Tensor

from nag_kernels import BACKENDS
from nag_lightning.residuals.nag.bounds import Bound
from nag_lightning.residuals.nag.parts import Part


class Angle(Part):
    """How far a write turns each token, and the write itself.

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers that write the stream.
        kernel: the write's backend, one of `nag_kernels.BACKENDS`.
    """

    DEFAULT_BOUND = "flat"
    """The bound this angle is built with when none is named."""
    BOUNDS: tuple[str, ...] | None = ("flat",)
    """The bounds it can turn within (None: any)."""
    ALPHA_INIT: float | None = None
    """The initial rotation scale alpha_l of every sublayer; None: 1/sqrt(n_sublayers)."""

    plans = False
    """Whether the angle is known before the sublayer runs (`planned`), so a router may read it."""

    def __init__(self, d_model: int, n_sublayers: int, kernel: str) -> None:
        super().__init__()
        if kernel not in BACKENDS:
            raise ValueError(f"kernel must be one of {BACKENDS}; got {kernel!r}.")
        self.d_model, self.n_sublayers, self.kernel = d_model, n_sublayers, kernel
        # the elements (tokens x d) of this pass's unrouted write, by which the write's backend is
        # chosen on CPU, so that a routed write of fewer rows runs as the pass's full writes do
        self.pass_elements: int | None = None

    @staticmethod
    def default_theta_max(n_sublayers: int) -> float:
        """theta_max when none is given: 4/N."""
        return 4.0 / n_sublayers

    def write(self, u: Tensor, rho: Tensor, f: Tensor, gate: Tensor | None, index: int, alpha: Tensor,
              beta: Tensor, bound: Bound) -> tuple[Tensor, Tensor, Tensor]:
        """(u', rho', theta): the write of sublayer `index`'s output f (..., d) into (u, rho), gated per
        token by the router's `gate` (...) or None, with the sublayer's scales `alpha`, `beta` and
        the `bound` on its angles; theta (...) is the signed angle turned."""
        raise NotImplementedError

    def planned(self, u: Tensor, index: int, bound: Bound) -> Tensor | None:
        """The angle (...) each token will turn by at gate 1, before the sublayer runs; None when
        only the write tells."""
        return None

    def start(self, tokens: int) -> None:
        """A forward pass of `tokens` tokens begins (the priced angle counts its turns per pass)."""
        # a compiled model fuses the traced write and never asks the size: no symbolic int kept
        self.pass_elements = None if torch.compiler.is_compiling() else tokens * self.d_model

    def aux_loss(self) -> Tensor | None:
        """A training loss of the last pass (the price on turning), or None."""
        return None
