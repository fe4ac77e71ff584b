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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    """

    executed: Tensor | None = None
    gate: Tensor | None = None


class Router(nn.Module):
    """Base class of routers; one instance per routed sublayer.

    After training, `nag-lightning sweep` traces accuracy against compute through the interface at
    the end of this class (`sweep_setting`, `sweeping`, `default_sweep_values`, `for_sweep`), so it
    handles any router, registered or named by class path, without knowing which it is.

    Args:
        d_model: width of the sublayer's read input.
    """

    routes: bool = True
    """Whether this router may skip tokens; False only for `none`, which runs every token."""

    reads_planned_angle: bool = False
    """Whether `forward` also takes `planned_angle`, the angle (B, T) the residual strategy will turn
    each token by, known before the sublayer runs (`ResidualStrategy.planned_angle`; None when the
    strategy has none). May be set per instance."""

    sweep_setting: str | None = None
    """The setting a post-training sweep varies (e.g. "tau", "capacity"), or None: nothing."""

    sweep_setting_is_angle: bool = False
    """Whether `sweep_setting` is a threshold in radians on the contribution angle, so the sweep
    also evaluates the oracle that skips where the measured angle is below the same value."""

    sweep_baseline: str | None = None
    """Name of a sweep row evaluated with the routers as trained, before any setting is changed
    (top-k: its causal predictor), or None for no such row."""

    sweep_labels: dict[str, str] = {}
    """Legend labels of the sweep's rows of this router (by row name), where its name says too
    little; the others are labelled '<name> (sweep of <setting>)'."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.aux_loss: Tensor = torch.zeros(())
        # With activation checkpointing a block's forward runs again during backward, so a router
        # that learns state (not parameters) in `observe` must leave that state alone until the
        # step's backward is done: the model sets this, and calls `apply_update` after backward.
        self.defer_updates = False

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
        in evaluation what runs there. Count matrix products only, as `nag_lightning.flops` does."""
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

    # ---- post-training sweep ------------------------------------------------------------------

    @contextmanager
    def sweeping(self, value: float) -> Iterator[None]:
        """Inside the block, evaluation routes with `sweep_setting` at `value`; on leaving it,
        the router is as it was. Needed when `sweep_setting` is not None."""
        raise NotImplementedError(f"{type(self).__name__} names no sweep_setting to sweep.")
        yield  # pragma: no cover - makes this a generator, as overrides are

    @classmethod
    def default_sweep_values(cls, routers: list[Router], inputs: list[Tensor]) -> list[float]:
        """The values of `sweep_setting` a sweep evaluates when the user gives none: `routers` are
        the model's routers of this class, `inputs` the read input h (B, T, d) each saw on one
        validation batch."""
        raise NotImplementedError(f"{cls.__name__} names no sweep_setting to sweep.")

    def for_sweep(self, fit_steps: int, **options: object) -> Router | None:
        """A router to put in this one's place before a post-training sweep of a model that was
        trained without routing, or None to sweep this one as it is. The sweep fits the new
        router's parameters (if it has any) on `fit_steps` training batches through its
        `aux_loss`, the model frozen, so it must learn from `observe` in training mode. `options`
        are the sweep's `router_options` for that router, passed only when the user gave some."""
        return None


ROUTERS: Registry[Router] = Registry("router", "nag_lightning.routers")


@ROUTERS.register("none")
class NoRouter(Router):
    """Every token runs every sublayer, with g = 1."""

    routes = False

    def forward(self, h: Tensor) -> Route:
        return Route()

    def for_sweep(self, fit_steps: int, **options: object) -> Router:
        """A model trained without routing is swept with threshold routers: the contribution angle
        needs no training of the model to predict, only of a probe (or none, with `predictor:
        angle` for a residual that knows its angle in advance). Every token runs while the probe
        is fitted."""
        cls = ROUTERS.get("threshold")
        ROUTERS.check_options(cls, options, ("d_model",), "router_options")
        return cls(self.d_model, **{"warmup_steps": fit_steps, **options})


def build_router(spec: str | dict, d_model: int, **options: object) -> Router:
    """Build one router from a YAML spec (a registered name or `{class_path, init_args}`);
    `options` override the spec's init_args."""
    cls, init_args = ROUTERS.resolve(spec)
    options = {**init_args, **options}
    ROUTERS.check_options(cls, options, ("d_model",), "model.arch.router_options")
    return cls(d_model=d_model, **options)


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ROUTERS", "NoRouter", "Route", "Router", "build_router"]
