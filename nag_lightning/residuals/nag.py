"""Norm-agnostic residual stream (NAG), arXiv 2606.16112 (Figliolia & Millidge, "Scaling Adaptive
Depth with Norm-Agnostic Residual Networks"), in the formulation of DESIGN section 2.

A token's state is a unit direction u and a log-norm rho, kept in separate lanes. Sublayers read
only the direction and write a rotation of it by at most θmax; their radial part moves rho. The
angle comes from a learned gate on the token's own direction, the direction of the turn from
the sublayer's tangential output f⊥:

    u ──┬─> √d·u·γ_l ─> F_l ─> f ─> a = <f,u>, f⊥ = f - a·u
        ├─> θ = θmax_l·sigmoid(c·<w_l, u> + b_l)·g       (θmax_l below, c = gate_gain = 1)
        └───────────────────────────────> u' = cos θ · u + sin θ · f⊥/|f⊥|      (|u'| = 1)
    rho ───────────────────────────────> rho' = rho + g·β_l·a/√d

Since every sublayer turns u by at most θmax whatever the state's history, a late layer matters as
much as an early one; θ is also the sublayer's contribution, the number routers threshold on. The
update runs through `nag_kernels.nag_write`: a fused Triton kernel on CUDA, the PyTorch reference
elsewhere.

The gate learns slowly (gate_gain 1): with a gain of √d an Adam step on w_l moved its logit by
about 0.8·d·lr, and where depth is the bottleneck the gates closed on the answers during the first
plateau, cutting the gradient to those sublayers by sin θ ≈ 0 (docs/results_tasks.md, the
diagnosis). Turning may be priced (angle_cost·mean(θ/θmax) joins the loss; with gate_radial the
radial update follows the gate): that closed the gates on the task as well, so the default does not
price it; `{gate_gain: sqrt_d, angle_cost: 0.03, gate_radial: true}` is the earlier default. The bound
decays with depth, θmax_l = θmax·sqrt(N / (H_N·(l+1))) with θmax = min(8/N, π/2) (at most π/2, the
squared bounds summing as flat ones do), so that early writes turn as far as Peri-LN's first
writes and later ones less, as a growing stream slows them; it trained better than the flat bound
(`bound_schedule: flat`, the default before) on the task and on text.

`angle="magnitude"`, the first formulation, takes the angle from the size of f instead:
θ = θmax·tanh(g·α_l·|f⊥| / (√d·θmax)) (θmax = 4/N). Adam then grows |f⊥| until nearly every token
sits on the bound (q10/q90 of θ 0.99-1.00), and θ says nothing about which tokens matter. The gate
cannot be pushed to the bound by scaling the sublayer, it is known before the sublayer runs, and it
trained better from 8 blocks on, as well at 4 (docs/results_history.md, sections 0 and 2).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from nag_kernels import BACKENDS, gated_angle, gated_nag_write, nag_write
from nag_lightning.inputs import shorten
from nag_lightning.residuals import RESIDUALS, ResidualStrategy, State
from nag_lightning.residuals.nag_settings import ANGLES, check_settings


@RESIDUALS.register("nag")
class NAGResidual(ResidualStrategy):
    """Direction lane u (unit norm) and log-norm lane rho; sublayers apply controlled rotations.

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers that read and write the stream.
        theta_max: bound on the angle one sublayer may turn a token by, in radians; None means
            min(8 / n_sublayers, pi / 2) for the gated angle, 4 / n_sublayers for the magnitude
            angle. Turns toward a direction many tokens share add up over depth, so the bound
            falls like 1/depth: with pi/2 every token collapses onto one direction within a few
            blocks. The best of 2/N, 4/N and 8/N for each angle (docs/results_history.md, 1).
        alpha_init: initial rotation scale of every sublayer (magnitude angle only); None means
            1/sqrt(n_sublayers).
        beta_init: initial scale of the radial (log-norm) update of every sublayer.
        norm_lane_readout: multiply the logits by exp(clamp(rho, -4, 4)), so the norm lane acts as
            a per-token inverse temperature; None means on. Without it nothing reads rho, beta
            gets no gradient, and with theta_max = 4/N training first stalls at unigram loss.
        bound: how the magnitude angle approaches theta_max: "tanh" (saturates exponentially)
            or "rational" (x / (1 + |x| / theta_max), whose gradient decays only like 1/x^2).
        kernel: "auto" (Triton on CUDA tensors; on CPU the write compiled by inductor for large
            eager writes, the PyTorch reference for small ones), "triton", "inductor" or "torch"
            (the reference always); see `nag_kernels.BACKENDS`.
        angle: "gate" (theta_max * sigmoid(sqrt(d) <w_l, u> + b_l) * g; alpha and bound are
            unused), "additive" (the turn u + g alpha_l f / sqrt(d) makes, renormalised: the
            additive residual's geometry at a norm held at sqrt(d); theta_max pi) or "magnitude"
            (the bounded size of the sublayer's tangential output); see
            the module docstring. None means "gate"; a checkpoint loads only into a model of its
            own angle, since the angle decides which parameters exist.
        gate_bias: initial b_l of the gated angle (0: every token starts at theta_max / 2).
        angle_cost: weight of a training loss on the gated angle, angle_cost times the mean over
            sublayers and tokens of theta / theta_max (added to the auxiliary loss): a price on
            turning, so a token turns only where the sublayer is worth it to the language loss,
            and skipping the tokens of smallest angle after training costs less. None means
            0 (0.03 was the default before the gate learned slowly), or, when a checkpoint is
            loaded, the price it was trained under; a value given wins over the
            checkpoint's, to go on training under it.
        gate_radial: scale the radial (log-norm) update of the gated angle by theta / theta_max
            as well, so a token its gate barely turns keeps its norm too: the whole write follows
            the gate, and skipping a token of small angle loses little of either lane. None
            means off (on was the default before the gate learned slowly), or, when a checkpoint
            is loaded, what it was trained with.
        gate_reads: what the gated angle's gate reads: "state" (the token's direction u alone,
            known before the sublayer runs) or "update" (u and the direction of what the
            sublayer wrote, f / |f|, with weights of their own initialised at 0: the angle then
            depends on the write, and no router can read it before the sublayer runs), or
            "tangent" (the gate on u times |f_perp| / |f|, the sine of the angle between f and u:
            an update along the state turns it little).
        learned_bound: the gated angle's bound is learned per sublayer, pi * sigmoid(s_l), s_l
            starting at theta_max, instead of fixed at theta_max.
        bound_schedule: how the gated angle's bound varies with the sublayer l: "flat"
            (theta_max everywhere) or "decaying" (theta_max * sqrt(c / (l + 1)), c = N / H_N so the
            squared bounds sum as the flat ones do, at most pi / 2): early writes may turn more and
            later ones less, as the l-th of equal-sized additive writes turns its stream by
            atan(1 / sqrt(l)) in pre-norm and Peri-LN. None means "decaying" for the gated angle
            with a fixed bound ("flat" before it trained better on tasks and text), "flat"
            otherwise, or, when a checkpoint is loaded, its own.
        channel_scale: the write turns toward c_l * f (a learned gain per channel and sublayer,
            starting at 1) instead of f: each dimension of the direction moves at its own rate,
            as nGPT's eigen learning rates (arXiv 2410.01131).
        inertia: with the additive angle, whether the norm lane feeds back into the step:
            "none"; "norm" (k = g alpha_l / (sqrt(d) exp(rho)), and rho follows the norm of
            u + k f: with alpha 1 and no norm lane at the readout this is the pre-norm stream,
            x = sqrt(d) exp(rho) u, in NAG's lanes, the ablation of the one thing NAG removes);
            or "lane" (the same k, with rho NAG's learned lane, rho + g beta_l a / sqrt(d): the
            model sets how much a token's state resists later turns).
        gate_gain: the scale of the gate's dot product with u (and with f / |f|), a positive
            number or "sqrt_d" (sqrt(d_model), with which an Adam step on w moves the gate's logit
            by about 0.8 * d_model * lr; a gain of 1 makes the gate learn sqrt(d_model) times
            slower). None means the default, or, when a checkpoint is loaded, its own.
    """

    def __init__(
        self,
        d_model: int,
        n_sublayers: int,
        theta_max: float | None = None,
        alpha_init: float | None = None,
        beta_init: float = 0.0,
        norm_lane_readout: bool | None = None,
        bound: str = "tanh",
        kernel: str = "auto",
        angle: str | None = None,
        gate_bias: float = 0.0,
        angle_cost: float | None = None,
        gate_radial: bool | None = None,
        gate_reads: str = "state",
        learned_bound: bool = False,
        bound_schedule: str | None = None,
        channel_scale: bool = False,
        gate_gain: float | str | None = None,
        inertia: str = "none",
    ) -> None:
        super().__init__(d_model, n_sublayers)
        # Which settings were given, not defaulted: a checkpoint's settings replace defaulted ones
        # and must agree with given ones (set_extra_state).
        self._given = {"theta_max": theta_max is not None, "norm_lane_readout": norm_lane_readout is not None,
                       "bound": bound != "tanh", "angle": angle is not None,
                       "angle_cost": angle_cost is not None, "gate_radial": gate_radial is not None,
                       "gate_gain": gate_gain is not None, "bound_schedule": bound_schedule is not None}
        angle = "gate" if angle is None else angle
        if theta_max is None and angle in ANGLES:
            # at most a right angle: in a model of one or two blocks 8/N would exceed it
            defaults = {"gate": min(8.0 / n_sublayers, math.pi / 2), "additive": math.pi}
            theta_max = defaults.get(angle, 4.0 / n_sublayers)
        norm_lane_readout = True if norm_lane_readout is None else norm_lane_readout
        if angle_cost is None:
            angle_cost = self.ANGLE_COST if angle == "gate" else 0.0
        if gate_radial is None:
            gate_radial = self.GATE_RADIAL and angle == "gate"
        gate_gain = self.GATE_GAIN if gate_gain is None else gate_gain
        if bound_schedule is None:  # a schedule of the gated angle's fixed bound only
            bound_schedule = self.BOUND_SCHEDULE if angle == "gate" and not learned_bound else "flat"
        check_settings(theta_max=theta_max, norm_lane_readout=norm_lane_readout, bound=bound, angle=angle,
                       angle_cost=angle_cost, gate_radial=gate_radial, gate_reads=gate_reads,
                       learned_bound=learned_bound, channel_scale=channel_scale, gate_gain=gate_gain,
                       inertia=inertia, bound_schedule=bound_schedule)
        if kernel not in BACKENDS:
            raise ValueError(f"kernel must be one of {BACKENDS}; got {kernel!r}.")
        self.angle_cost = angle_cost
        self.gate_radial = gate_radial
        self.gate_reads, self.learned_bound, self.channel_scale = gate_reads, learned_bound, channel_scale
        self.gate_gain, self.inertia, self.bound_schedule = gate_gain, inertia, bound_schedule
        # this training pass's sum of theta / theta_max over writes and tokens (None: nothing
        # priced yet), and its number of tokens: a routed write sees only its executed tokens, and
        # a skipped token turns by 0. A tensor, not a list: a list's length would be guarded
        # under torch.compile and recompile every routed sublayer's graph.
        self._turned: Tensor | None = None
        self._tokens = 0
        self.theta_max = theta_max
        self.norm_lane_readout = norm_lane_readout
        self.kernel = kernel
        self.bound = bound
        if alpha_init is None:
            alpha_init = 1.0 if angle == "additive" else 1 / math.sqrt(n_sublayers)
        self.gamma = nn.Parameter(torch.ones(n_sublayers, d_model))
        self.gamma_out = nn.Parameter(torch.ones(d_model))
        self.alpha = nn.Parameter(torch.full((n_sublayers,), float(alpha_init)))
        self.beta = nn.Parameter(torch.full((n_sublayers,), float(beta_init)))
        self.angle = angle
        if angle == "gate":  # only then: a magnitude-angle checkpoint keeps its parameters
            self.gate_w = nn.Parameter(torch.zeros(n_sublayers, d_model))
            self.gate_b = nn.Parameter(torch.full((n_sublayers,), float(gate_bias)))
        if gate_reads == "update":
            self.gate_v = nn.Parameter(torch.zeros(n_sublayers, d_model))
        if learned_bound:
            start = math.log(theta_max / (math.pi - theta_max)) if theta_max < math.pi else 4.0
            self.bound_logit = nn.Parameter(torch.full((n_sublayers,), start))
        if channel_scale:
            self.channel_gain = nn.Parameter(torch.ones(n_sublayers, d_model))

    # The defaults of the gated angle: a slow gate, unpriced, trained the multi-hop skill at 8 blocks
    # where the fast priced gate did not, and did better on text (docs/results_tasks.md).
    ANGLE_COST = 0.0
    GATE_RADIAL = False
    GATE_GAIN: float | str = 1.0
    BOUND_SCHEDULE = "decaying"

    # The resolved settings travel in the state dict, so a checkpoint loads with the settings it
    # was trained under even after a default changes.
    SETTINGS = ("theta_max", "norm_lane_readout", "bound", "angle", "angle_cost", "gate_radial", "gate_reads",
                "learned_bound", "channel_scale", "gate_gain", "inertia",
                "bound_schedule")
    # Settings that decide which parameters exist: a checkpoint loads only into a model built with
    # its own values.
    STRUCTURE = ("angle", "gate_reads", "learned_bound", "channel_scale")
    # Settings of the training objective, not of the function the weights compute: a value given
    # to the model (to go on training under another price) wins over the checkpoint's.
    OBJECTIVE = ("angle_cost",)

    def get_extra_state(self) -> dict:
        return {name: getattr(self, name) for name in self.SETTINGS}

    def set_extra_state(self, state: dict) -> None:
        if not isinstance(state, dict):
            # torch.distributed.checkpoint's placeholder for an extra state it does not load
            # (Lightning's ModelParallelStrategy reads a consolidated checkpoint one parameter at
            # a time): the settings stay the ones this model was built with, from the same run.
            return
        given = {name: getattr(self, name) for name in self.OBJECTIVE if self._given[name]}
        for name, value in state.items():
            if self._given.get(name) and name not in given and value != getattr(self, name):
                raise ValueError(
                    f"The checkpoint was trained with {name}={value}; this model was given "
                    f"{name}={getattr(self, name)}: drop the option or give the checkpoint's value."
                )
        for name in self.STRUCTURE:  # these decide the parameters
            if state.get(name, getattr(self, name)) != getattr(self, name):
                saved = shorten(str(state[name]))
                raise ValueError(
                    f"The checkpoint was trained with {name}={saved}; this model was built with "
                    f"{name}={getattr(self, name)}: give residual_options {name}={saved}."
                )
        settings = {name: given.get(name, state.get(name, getattr(self, name))) for name in self.SETTINGS}
        if settings["angle_cost"] and settings["angle"] != "gate":
            raise ValueError(f"The checkpoint was trained with angle={settings['angle']}, and angle_cost "
                             "prices the gated angle only: drop angle_cost.")
        self.check_saved(settings)  # the constructor's rules: saved settings may come from anyone
        for name, value in settings.items():
            setattr(self, name, value)

    def check_saved(self, settings: dict) -> None:
        """One sentence for saved settings this strategy cannot run with."""
        check_settings(**{name: settings[name] for name in NAGResidual.SETTINGS})

    def init_state(self, embedding: Tensor) -> State:
        self._turned, self._tokens = None, embedding.shape[:-1].numel()
        e = embedding.float()
        norm = e.norm(dim=-1).clamp_min(1e-12)
        return e / norm.unsqueeze(-1), torch.log(norm / math.sqrt(self.d_model))

    def read(self, state: State, index: int) -> Tensor:
        u, _ = state
        # the constant goes on the (d,) gain, not the (B, T, d) state: one full-size multiply, not two
        return u * (math.sqrt(self.d_model) * self.gamma[index])

    def write(
        self, state: State, f: Tensor, gate: Tensor | None, index: int, need_angle: bool = True
    ) -> tuple[State, Tensor | None]:
        u, rho = state
        if self.channel_scale:
            f = f * self.channel_gain[index].to(f.dtype)
        if self.angle == "gate" and self._angle_outside:
            return self._given_write(u, rho, f, gate, index)
        if self.angle == "gate":
            return self._gated_write(u, rho, f, gate, index)
        if self.angle == "additive":
            return self._additive_write(u, rho, f, gate, index)
        u_new, rho_new, theta, _ = nag_write(
            u, f, rho, gate, self.alpha[index], self.beta[index], self.theta_max,
            backend=self.kernel, bound=self.bound,
        )
        return (u_new, rho_new), theta.detach().abs()

    def gate_angle(self, u: Tensor, index: int) -> Tensor:
        """The gated angle of every token before any router's gate, (...,) in fp32: known from the
        token's own direction before the sublayer runs (with gate_reads "state")."""
        return gated_angle(u, self.gate_w[index], self.gate_b[index], self.bound_of(index), self.gain)

    @property
    def gain(self) -> float:
        """The scale of the gate's dot products: gate_gain, "sqrt_d" meaning sqrt(d_model)."""
        return math.sqrt(self.d_model) if self.gate_gain == "sqrt_d" else float(self.gate_gain)

    def bound_of(self, index: int) -> float | Tensor:
        """Sublayer `index`'s bound on the gated angle: theta_max, its learned bound, or its share
        of the decaying schedule."""
        if self.learned_bound:
            return math.pi * torch.sigmoid(self.bound_logit[index])
        if self.bound_schedule == "decaying":
            harmonic = sum(1 / (i + 1) for i in range(self.n_sublayers))
            return min(self.theta_max * math.sqrt(self.n_sublayers / harmonic / (index + 1)), math.pi / 2)
        return self.theta_max

    @property
    def _angle_outside(self) -> bool:
        """Whether the gated angle is computed here and given to the write, rather than inside
        the fused gated write (which knows the fixed bound and the gate on u only)."""
        return self.gate_reads != "state" or self.learned_bound

    @property
    def plans_angle(self) -> bool:
        return self.angle == "gate" and self.gate_reads == "state"

    def planned_angle(self, state: State, index: int) -> Tensor | None:
        """The gated angle, known before the sublayer runs; None for the magnitude angle and for
        a gate that reads the update."""
        if not self.plans_angle:
            return None
        return self.gate_angle(state[0], index)

    def _given_write(self, u: Tensor, rho: Tensor, f: Tensor, gate: Tensor | None, index: int):
        """The gated write with its angle computed here: from the update too (gate_reads
        "update" or "tangent"), or under a learned bound."""
        bound = self.bound_of(index)
        logit = self.gain * (u.float() @ self.gate_w[index].float()) + self.gate_b[index].float()
        if self.gate_reads != "state":  # f's size, only where the gate reads the update
            f32 = f.float()
            size = torch.linalg.vector_norm(f32, dim=-1, keepdim=True).clamp_min(1e-12)
        if self.gate_reads == "update":
            logit = logit + self.gain * ((f32 / size) @ self.gate_v[index].float())
        share = torch.sigmoid(logit)  # the angle's share of the bound
        if self.gate_reads == "tangent":
            # times sin of the angle between f and u: an update that agrees with the state turns
            # it little, rather than a full gated angle toward the rounding of its perpendicular part
            radial = (f32 * u.float()).sum(-1, keepdim=True) / size
            share = share * (1 - radial.square()).clamp_min(0).sqrt().squeeze(-1)
        if gate is not None:
            share = share * gate.float()
        angle = bound * share
        u_new, rho_new, theta, _ = nag_write(
            u, f, rho, share if self.gate_radial else gate, self.alpha[index], self.beta[index],
            self.theta_max, backend=self.kernel, angle=angle,
        )
        if self.angle_cost and self.training:
            turned = share.sum()
            self._turned = turned if self._turned is None else self._turned + turned
        return (u_new, rho_new), theta.detach().abs()

    def _gated_write(self, u: Tensor, rho: Tensor, f: Tensor, gate: Tensor | None, index: int):
        # With a given angle the write's gate scales only the radial update: by the angle's share
        # of the bound (gate_radial), or by the router's gate.
        bound = self.bound_of(index)
        u_new, rho_new, theta, angle = gated_nag_write(
            u, f, rho, gate, self.alpha[index], self.beta[index], bound, self.gate_w[index],
            self.gate_b[index], self.gain, radial=self.gate_radial, backend=self.kernel,
        )  # fmt: skip
        if self.angle_cost and self.training:
            turned = angle.sum() / bound
            self._turned = turned if self._turned is None else self._turned + turned
        return (u_new, rho_new), theta.detach().abs()

    def _additive_write(self, u: Tensor, rho: Tensor, f: Tensor, gate: Tensor | None, index: int):
        """u' = (u + k f) / |u + k f| with k = g alpha_l / sqrt(d): the turn an additive residual
        gives a state of norm sqrt(d), atan2(k |f_perp|, 1 + k a), then the norm is set back."""
        f32, u32 = f.float(), u.float()
        k = self.alpha[index].float() / math.sqrt(self.d_model)
        if gate is not None:
            k = k * gate.float()
        if self.inertia != "none":  # the step relative to the state's norm sqrt(d) exp(rho), as pre-norm's
            k = k * torch.exp(-rho.float())
        a = (f32 * u32).sum(-1)
        n = torch.linalg.vector_norm(f32 - a.unsqueeze(-1) * u32, dim=-1)
        angle = torch.atan2(k * n, 1 + k * a)
        if self.inertia == "norm":  # rho follows the norm of u + k f: pre-norm's x = sqrt(d) exp(rho) u
            u_new, _, theta, _ = nag_write(u, f, rho, gate, self.alpha[index], 0.0, self.theta_max,
                                           backend=self.kernel, angle=angle)
            rho_new = rho + 0.5 * torch.log((1 + k * a).square() + (k * n).square())
            return (u_new, rho_new.to(rho.dtype)), theta.detach().abs()
        u_new, rho_new, theta, _ = nag_write(
            u, f, rho, gate, self.alpha[index], self.beta[index], self.theta_max, backend=self.kernel,
            angle=angle,
        )
        return (u_new, rho_new), theta.detach().abs()

    def aux_loss(self) -> Tensor | None:
        """angle_cost times the mean share of the bound the last training pass turned by."""
        if self._turned is None:
            return None
        return self.angle_cost * self._turned / (self.n_sublayers * self._tokens)

    def final(self, state: State) -> tuple[Tensor, Tensor | None]:
        u, rho = state
        features = u * (math.sqrt(self.d_model) * self.gamma_out)
        if not self.norm_lane_readout:
            return features, None
        return features, torch.exp(rho.clamp(-4.0, 4.0)).unsqueeze(-1)

    def state_norm(self, state: State) -> Tensor:
        _, rho = state
        return torch.exp(rho)
