"""Routers: Mixture-of-Depths decisions, per token and per routed sublayer (DESIGN section 4).

A router sees the sublayer's read input h (B, T, d) and returns a `Route`: which tokens execute the
sublayer and the gate g each executed token writes with. The sublayer wrapper gathers the executed
tokens, runs the sublayer on them alone and scatters the results back, so skipped tokens cost no
compute. After the write the wrapper hands the router the measured contribution angle of the
executed tokens (`observe`), which a router may learn from; its auxiliary loss is added to the LM
loss and its statistics are logged. State it learns outside gradients (a threshold) is computed in
`observe` and written by `apply_update`, so a forward pass that activation checkpointing runs again
in backward computes the same update and applies nothing twice.

One router instance serves one sublayer. Which sublayers are routed (kinds, layers) is the model's
choice, so every router gets it for free.

Adding a router takes one file in this folder: subclass `Router`, decorate it with
`@ROUTERS.register("name")`; every module here is imported below, so it is registered on import.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from nag_lightning.registry import Registry


@dataclass
class Route:
    """A routing decision for one sublayer.

    Attributes:
        executed: (B, T) bool, the tokens that run the sublayer; None means all of them.
        gate: (B, T) gate g in [0, 1] the executed tokens write with; None means 1.
        positions: (B, K) the executed tokens' positions, increasing along each row, where every
            sequence executes the same number K (top-k); the sublayer then gathers them with
            static shapes. None: the sublayer finds them in `executed`.
    """

    executed: Tensor | None = None
    gate: Tensor | None = None
    positions: Tensor | None = None


def shares_of_training(**shares: float) -> tuple[float, ...]:
    """The shares as floats, after checking each lies in [0, 1] and together they fit the run."""
    for name, value in shares.items():
        if not 0 <= value <= 1:
            raise ValueError(f"router_options.{name} is a share of training, in [0, 1] (e.g. 0.1); "
                             f"got {value}.")
    if sum(shares.values()) > 1:
        raise ValueError(f"router_options.{' + '.join(shares)} is {sum(shares.values()):g}, more than the "
                         "whole run; lower one of them.")
    return tuple(float(v) for v in shares.values())


def ramped(progress: float, start: float, ramp: float) -> float:
    """A schedule's share at `progress`: 0 before `start`, then rising linearly to 1 over `ramp`
    (at once when `ramp` is 0); all three are shares of the run."""
    if progress < start:
        return 0.0
    return 1.0 if ramp <= 0 else min(1.0, (progress - start) / ramp)


class Router(nn.Module):
    """Base class of routers; one instance per routed sublayer. It holds what the model calls; what
    `nag-lightning sweep` asks of a router lives with the sweep (`nag_lightning.analysis.sweeps.sweepable`).

    Args:
        d_model: width of the sublayer's read input.
    """

    routes: bool = True
    """Whether this router may skip tokens; False only for `none`, which runs every token."""

    reads_planned_angle: bool = False
    """Whether `forward` also takes `planned_angle`, the angle (B, T) the residual strategy will turn
    each token by, known before the sublayer runs (`ResidualStrategy.planned_angle`; None when the
    strategy has none). May be set per instance."""

    needs_contribution: bool = False
    """Whether `observe` needs the measured contribution angle in every training and evaluation
    pass (the threshold router regresses on it). False (the default) lets a residual strategy skip
    computing the angle when nothing else records it, so `observe` may then get None."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.aux_loss: Tensor = torch.zeros(())
        # With activation checkpointing a block's forward runs again during backward, so a router
        # that learns state (not parameters) in `observe` must leave that state alone until the
        # step's backward is done: the model sets this, and calls `apply_update` after backward.
        self.defer_updates = False
        self.full_depth_share = 0.0
        self.ramp_share = 0.0
        self.rate_scale = 1.0  # the share of its skip rate the router skips at now: see set_progress

    def set_rate_warmup(self, full_depth_share: float, ramp_share: float) -> None:
        """A skip-rate warm-up: every token runs for the first `full_depth_share` of training, then
        the skip rate rises linearly to the router's target over the next `ramp_share`, so the
        model learns what is worth keeping before tokens skip. Shares of the run as
        `set_progress` measures it (of its steps, or of its FLOP budget when one ends it)."""
        self.full_depth_share, self.ramp_share = shares_of_training(full_depth_share=full_depth_share,
                                                                    ramp_share=ramp_share)

    def set_progress(self, progress: float) -> None:
        """How far training has come, 0 to 1: the LightningModule calls it before every training
        step (the share of its steps, or of the FLOP budget when one ends the run, so a resumed
        run continues where it was). It sets `rate_scale`, the share of the target skip rate the
        warm-up allows now: 0 at full depth, 1 once ramped. Outside training, and for a model
        nothing calls this on, `rate_scale` stays 1: evaluation and generation route at the target."""
        self.rate_scale = ramped(progress, self.full_depth_share, self.ramp_share)

    def forward(self, h: Tensor) -> Route:
        """Decide from the read input h (B, T, d) which tokens run the sublayer (a router that
        `reads_planned_angle` is called as `forward(h, planned_angle=...)`)."""
        raise NotImplementedError

    @property
    def causal(self) -> bool:
        """Whether, in eval mode, a token's decision and gate read only its own h. Generation with
        a KV cache relies on it: it calls the router on the new tokens alone (often T = 1, with
        padding tokens whose decisions it ignores) and never calls `observe`. A router whose
        eval-mode decision looks at other tokens must return False, and cached generation then
        refuses it."""
        return True

    def use_causal(self) -> Callable[[], None] | None:
        """Switch eval mode to a causal decision where the router has one besides a non-causal one
        (top-k: its predictor), for generation; returns what switches back, or None when there is
        nothing to switch (then `causal` alone decides whether generation may use the router)."""
        return None

    def observe(self, h: Tensor, route: Route, contribution: Tensor) -> None:
        """Learn from the write: `contribution` (B, T) is the measured angle (0 where skipped).
        Sets `self.aux_loss` for this forward pass."""
        self.aux_loss = h.new_zeros(())

    def apply_update(self) -> None:
        """Apply the state update (buffers such as thresholds) the last training `observe`
        computed; nothing when none is pending. `observe` calls it itself unless `defer_updates`.
        A router whose `observe` updates state must compute the update from the state as it was
        at the start of the forward pass, so that running the pass again changes nothing."""

    def flops_per_token(self) -> int:
        """Forward FLOPs (2 x multiply-adds) the router spends per token it scores, for accounting,
        in its current mode (`self.training`): in training what `forward` and `observe` run there,
        in evaluation what runs there. Count matrix products only, as `nag_lightning.model.flops` does."""
        return 0

    def backward_flops_per_token(self) -> int:
        """Backward FLOPs the router spends per token it scores in a training pass: by default two
        matrix products per forward one (the input's gradient and the weights'). A part that reads
        a detached input has no input gradient, so it costs one; one that nothing trains, none."""
        return 2 * self.flops_per_token()

    def stats(self) -> dict[str, float]:
        """Router-specific numbers to log (auxiliary losses, predictor accuracy, thresholds)."""
        return {}

    def evaluation_note(self) -> str | None:
        """A sentence for the logs when evaluation's routing cannot be trusted yet in the router's
        current state (a threshold still settling), or None (the default)."""
        return None


ROUTERS: Registry[Router] = Registry("router", "nag_lightning.routers")


@ROUTERS.register("none")
class NoRouter(Router):
    """Every token runs every sublayer, with g = 1."""

    routes = False

    def forward(self, h: Tensor) -> Route:
        return Route()


def build_router(spec: str | dict, d_model: int, **options: object) -> Router:
    """Build one router from a YAML spec (a registered name or `{class_path, init_args}`);
    `options` override the spec's init_args."""
    cls, init_args = ROUTERS.resolve(spec)
    options = {**init_args, **options}
    ROUTERS.check_options(cls, options, ("d_model",), "model.arch.router_options")
    return cls(d_model=d_model, **options)


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ROUTERS", "NoRouter", "Route", "Router", "build_router", "ramped", "shares_of_training"]
