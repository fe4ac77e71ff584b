"""Norm-agnostic residual stream (NAG), arXiv 2606.16112 (Figliolia & Millidge, "Scaling Adaptive
Depth with Norm-Agnostic Residual Networks"), in the formulation of DESIGN section 2.

A token's state is a unit direction u and a log-norm rho, kept in separate lanes. Sublayers read
only the direction and write a rotation of it; their radial part moves rho. How far a write turns
a token is the angle part's choice (`ANGLES`), within the bound part's limit for that sublayer
(`BOUNDS`). The default, a gate on the token's direction within a bound that decays with depth:

    u ──┬─> √d·u·γ_l ─> F_l ─> f ─> a = <f,u>, f⊥ = f - a·u
        ├─> θ = θ_l·sigmoid(<w_l, u> + b_l)·g                  θ_l = bound.of(l)
        └───────────────────────────────> u' = cos θ · u + sin θ · f⊥/|f⊥|      (|u'| = 1)
    rho ───────────────────────────────> rho' = rho + g·β_l·a/√d
    logits = W_out(√d·u_L·γ_out) · exp(clamp(rho_L, -4, 4))

Since every sublayer turns u by at most its bound whatever the state's history, a late layer
matters as much as an early one; θ is also the sublayer's contribution, the number routers
threshold on.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from nag_lightning.inputs import shorten
from nag_lightning.residuals import RESIDUALS, State
from nag_lightning.residuals.nag.angle import Angle
from nag_lightning.residuals.nag.bounds import Bound
from nag_lightning.residuals.nag.lanes import DirectionAndNormLanes
from nag_lightning.residuals.nag.parts import (
    ANGLES,
    BOUNDS,
    check_flag,
    disagreement,
    refuse_unknown,
    registered,
)


class ChannelGain(nn.Module):
    """A learned gain c_l per channel and sublayer, starting at 1: the write turns toward c_l·f, so
    each dimension of the direction moves at its own rate, as nGPT's eigen learning rates
    (arXiv 2410.01131)."""

    def __init__(self, n_sublayers: int, d_model: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n_sublayers, d_model))

    def forward(self, f: Tensor, index: int) -> Tensor:
        return f * self.gain[index].to(f.dtype)


@RESIDUALS.register("nag")
class NAGResidual(DirectionAndNormLanes):
    """Direction lane u (unit norm) and log-norm lane rho; sublayers turn u by the angle part's
    choice within the bound part's limit.

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers that read and write the stream.
        angle: how a write's angle is chosen, a registered `ANGLES` name: "gate" (the default),
            "gate_update", "gate_tangent", "magnitude", "additive". Its options (e.g. gate_gain,
            angle_cost, saturation, inertia) are given beside the others in residual_options.
        bound: how the bound varies with depth, a registered `BOUNDS` name: "decaying", "flat"
            or "learned"; None means the angle's own (decaying for the gates, flat otherwise).
        theta_max: the bound's scale in radians; None means the angle's own (min(8/N, pi/2) for
            the gates, 4/N for the magnitude angle, pi for the additive one).
        norm_lane_readout: multiply the logits by exp(clamp(rho, -4, 4)), so the norm lane acts as
            a per-token inverse temperature; None means on. Without it nothing reads rho.
        alpha_init: initial rotation scale alpha_l of the magnitude and additive angles; None
            means the angle's own (1/sqrt(n_sublayers); 1 for the additive angle).
        beta_init: initial scale of the radial (log-norm) update of every sublayer.
        channel_scale: the write turns toward a learned per-channel gain times f (`ChannelGain`).
        kernel: the write's backend, one of `nag_kernels.BACKENDS`: "auto" (Triton on CUDA
            tensors; on CPU the write compiled by inductor for large eager writes, the PyTorch
            reference for small ones), "triton", "inductor" or "torch".
        **angle_options: the angle's own options.

    A checkpoint saves each part's name and settings, and loads with them: a setting this model
    was not given takes the checkpoint's value, one it was given must agree.
    """

    SETTINGS = ("angle", "bound", "norm_lane_readout", "channel_scale")

    def __init__(self, d_model: int, n_sublayers: int, angle: str | None = None, bound: str | None = None,
                 theta_max: float | None = None, norm_lane_readout: bool | None = None,
                 alpha_init: float | None = None, beta_init: float = 0.0, channel_scale: bool = False,
                 kernel: str = "auto", **angle_options: Any) -> None:
        super().__init__(d_model, n_sublayers)
        given = {"angle": angle, "bound": bound, "norm_lane_readout": norm_lane_readout}
        self._given = {name for name, value in given.items() if value is not None}
        kind = registered(ANGLES, "gate" if angle is None else angle, "angle")
        self._check_options(kind, angle_options)
        norm_lane_readout = True if norm_lane_readout is None else norm_lane_readout
        check_flag("norm_lane_readout", norm_lane_readout)
        check_flag("channel_scale", channel_scale)
        self.norm_lane_readout, self.channel_scale = norm_lane_readout, channel_scale
        alpha_init = (kind.ALPHA_INIT or 1 / math.sqrt(n_sublayers)) if alpha_init is None else alpha_init
        self.gamma = nn.Parameter(torch.ones(n_sublayers, d_model))
        self.gamma_out = nn.Parameter(torch.ones(d_model))
        self.alpha = nn.Parameter(torch.full((n_sublayers,), float(alpha_init)))
        self.beta = nn.Parameter(torch.full((n_sublayers,), float(beta_init)))
        # parts after the lanes' own parameters, angle before bound before channel gains: the
        # order of the optimizer's state in checkpoints
        self.angle: Angle = kind(d_model, n_sublayers, kernel, **angle_options)
        self._theta_max = theta_max
        self.bound: Bound = self._build_bound(kind.DEFAULT_BOUND if bound is None else bound)
        self.channel = ChannelGain(n_sublayers, d_model) if channel_scale else None

    def _check_options(self, kind: type[Angle], options: dict) -> None:
        ANGLES.check_options(kind, options, ("d_model", "n_sublayers", "kernel"),
                             f"model.arch.residual_options (beside NAG's own: {', '.join(NAG_OPTIONS)})")

    def _build_bound(self, name: object) -> Bound:
        """The bound part `name` for this model's angle, which must be able to turn within it."""
        bound = registered(BOUNDS, name, "bound")(self.n_sublayers, self._theta_max,
                                                  self.angle.default_theta_max(self.n_sublayers))
        takes = self.angle.BOUNDS
        if takes is not None and bound.name not in takes:
            raise ValueError(f"The {self.angle.name} angle turns within a bound of {' or '.join(takes)}; "
                             f"got bound={bound.name!r}: drop bound, or give bound: {takes[0]}.")
        return bound

    def get_extra_state(self) -> dict:
        return {"angle": self.angle.name, "bound": self.bound.name,
                "norm_lane_readout": self.norm_lane_readout, "channel_scale": self.channel_scale}

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, dict):
            # torch.distributed.checkpoint's placeholder for an extra state it does not load
            # (Lightning's ModelParallelStrategy reads a consolidated checkpoint one parameter at
            # a time): the settings stay the ones this model was built with, from the same run
            return
        refuse_unknown(state, self.SETTINGS, "NAG")
        mine = self.get_extra_state()
        for name, saved in state.items():
            if saved == mine[name]:
                continue
            if name in self._given:
                raise disagreement(name, saved, mine[name])
            if name == "norm_lane_readout":
                check_flag(name, saved)
                self.norm_lane_readout = saved
            elif name == "bound" and not self.bound.has_parameters and self._swap_bound(saved):
                continue
            else:  # the part, or the gains, decide which parameters exist
                raise ValueError(f"The checkpoint was trained with {name}={shorten(saved)}; this model "
                                 f"was built with {name}={mine[name]}: give residual_options "
                                 f"{name}={shorten(saved)}.")

    def _swap_bound(self, name: object) -> bool:
        """Take the checkpoint's bound in place of the default one, where neither has parameters
        (its settings load next, as the part's own state)."""
        bound = self._build_bound(name)
        if bound.has_parameters:
            return False
        self.bound = bound
        return True

    def init_state(self, embedding: Tensor) -> State:
        self.angle.start(embedding.shape[:-1].numel())
        return self.lanes_of(embedding)

    def write(
        self, state: State, f: Tensor, gate: Tensor | None, index: int, need_angle: bool = True
    ) -> tuple[State, Tensor | None]:
        u, rho = state
        if self.channel is not None:
            f = self.channel(f, index)
        u_new, rho_new, theta = self.angle.write(u, rho, f, gate, index, self.alpha[index], self.beta[index],
                                                 self.bound)
        return (u_new, rho_new), theta.detach().abs()

    def bound_of(self, index: int) -> float | Tensor:
        """Sublayer `index`'s bound on the angle it may turn a token by, in radians."""
        return self.bound.of(index)

    @property
    def plans_angle(self) -> bool:
        return self.angle.plans

    def planned_angle(self, state: State, index: int) -> Tensor | None:
        """The angle known before the sublayer runs (the gate on u); None for other angles."""
        return self.angle.planned(state[0], index, self.bound)

    def aux_loss(self) -> Tensor | None:
        return self.angle.aux_loss()

    @property
    def training_callbacks(self) -> tuple[str, ...]:
        """The run's length, by which the write on CPU decides whether compiling it pays."""
        return (*super().training_callbacks, "nag_lightning.callbacks.RunLength")


NAG_OPTIONS = ("angle", "bound", "theta_max", "norm_lane_readout", "alpha_init", "beta_init", "channel_scale",
               "kernel")
