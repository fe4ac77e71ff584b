"""What `nag-lightning sweep` asks of a router to vary it after training, kept out of `Router`.

A router trains and generates through `Router` alone. To be swept it also implements `Sweepable` on
its own class (a router of another package, or a new one in `nag_lightning/routers/`: one file, no
edits here), or an adapter registered here for its class speaks for it (the built-in routers:
`@sweeps(ThresholdRouter)`), so the router classes hold only what the model calls. The sweep reads
either through `sweep_of(router class)`, a `RouterSweep`; a router with neither is refused by the
sweep in one sentence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from nag_lightning.routers import ROUTERS, NoRouter, Router
from nag_lightning.routers.threshold import ThresholdRouter
from nag_lightning.routers.topk import TopKRouter

SWEEP_RATE_QUANTILES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6)
"""Quantiles of the predicted angles a post-training sweep puts tau at by default: MoD rates from
0 to about 60%."""

SWEEP_CAPACITIES = (1.0, 0.9, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4, 0.3)
"""The capacities a post-training sweep evaluates the exact top-k at by default."""


class Sweepable(Protocol):
    """The members a router class defines to be swept after training (`sweep_setting`,
    `sweeping`, `default_sweep_values`); the others are optional and default as shown."""

    sweep_setting: ClassVar[str]
    """The setting the sweep varies, e.g. "tau" or "capacity"; the router's attribute of that name
    holds the value it trained with."""

    sweep_setting_is_angle: ClassVar[bool] = False
    """Whether the setting is a threshold in radians on the contribution angle, so the sweep also
    evaluates the oracle that skips where the measured angle is below the same value."""

    sweep_baseline: ClassVar[str | None] = None
    """Name of a sweep row evaluated with the routers as trained, before any setting is changed
    (top-k: its causal predictor), or None for no such row."""

    sweep_labels: ClassVar[dict[str, str]] = {}
    """Legend labels of the sweep's rows (by row name), where the name says too little."""

    def sweeping(self, value: float) -> AbstractContextManager[None]:
        """Inside the block, evaluation routes with the setting at `value`; on leaving it, the
        router is as it was."""

    @classmethod
    def default_sweep_values(cls, routers: list[Router], inputs: list[Tensor]) -> list[float]:
        """The values swept when the user gives none: `routers` are the model's routers of this
        class, `inputs` the read input h (B, T, d) each saw on one validation batch."""

    def for_sweep(self, fit_steps: int, **options: object) -> Router | None:
        """Optional: a router to put in this one's place to sweep a model trained without routing,
        or None (the default) to sweep this one as it is. The sweep fits its parameters, if any, on
        `fit_steps` training batches through its `aux_loss`, the model frozen, so it must learn from
        `observe` in training mode; `options` are the sweep's --router_options, given only when set."""


class RouterSweep:
    """How the sweep varies one router class; the members of `Sweepable`, with the router passed
    in. The base sweeps nothing and replaces nothing."""

    setting: str | None = None
    setting_is_angle = False
    baseline: str | None = None
    labels: dict[str, str] = {}

    def sweeping(self, router: Router, value: float) -> AbstractContextManager[None]:
        raise NotImplementedError(f"{type(router).__name__} names no setting to sweep.")

    def default_values(self, routers: list[Router], inputs: list[Tensor]) -> list[float]:
        raise NotImplementedError("This router names no setting to sweep.")

    def replacement(self, router: Router, fit_steps: int, **options: object) -> Router | None:
        return None


class OwnSweep(RouterSweep):
    """A router class that implements `Sweepable` itself, read through its members."""

    def __init__(self, cls: type[Router]) -> None:
        self.cls = cls
        self.setting = getattr(cls, "sweep_setting", None)  # None: it only offers a replacement
        # the optional members, with the protocol's defaults
        self.setting_is_angle = getattr(cls, "sweep_setting_is_angle", Sweepable.sweep_setting_is_angle)
        self.baseline = getattr(cls, "sweep_baseline", Sweepable.sweep_baseline)
        self.labels = getattr(cls, "sweep_labels", Sweepable.sweep_labels)

    def sweeping(self, router: Router, value: float) -> AbstractContextManager[None]:
        return router.sweeping(value)

    def default_values(self, routers: list[Router], inputs: list[Tensor]) -> list[float]:
        return self.cls.default_sweep_values(routers, inputs)

    def replacement(self, router: Router, fit_steps: int, **options: object) -> Router | None:
        for_sweep = getattr(router, "for_sweep", None)
        return None if for_sweep is None else for_sweep(fit_steps, **options)


SWEEPS: dict[type[Router], RouterSweep] = {}
"""The adapters of the built-in routers, by router class."""


def sweeps(router_class: type[Router]) -> Callable[[type[RouterSweep]], type[RouterSweep]]:
    """Register the decorated `RouterSweep` as the adapter of `router_class` (and its subclasses
    that define no sweep of their own); refuses a second one."""

    def decorator(cls: type[RouterSweep]) -> type[RouterSweep]:
        if router_class in SWEEPS:
            raise ValueError(f"{router_class.__name__} already has a sweep adapter.")
        SWEEPS[router_class] = cls()
        return cls

    return decorator


def sweep_of(router_class: type[Router]) -> RouterSweep | None:
    """How the sweep varies `router_class`: the nearest class in its hierarchy that implements
    `Sweepable` (defines `sweep_setting` or `for_sweep`) or has a registered adapter decides;
    None: it cannot be swept."""
    for cls in router_class.__mro__:
        if "sweep_setting" in vars(cls) or "for_sweep" in vars(cls):
            return OwnSweep(router_class)
        if cls in SWEEPS:
            return SWEEPS[cls]
    return None


@sweeps(NoRouter)
class UnroutedSweep(RouterSweep):
    """A model trained without routing is swept with threshold routers: the contribution angle
    needs no training of the model to predict, only of a probe (or none, with `predictor: angle`
    for a residual that knows its angle in advance). Every token runs while the probe is fitted."""

    def replacement(self, router: Router, fit_steps: int, **options: object) -> Router:
        cls = ROUTERS.get("threshold")
        ROUTERS.check_options(cls, options, ("d_model",), "router_options")
        return cls(router.d_model, **{"warmup_steps": fit_steps, **options})


@sweeps(ThresholdRouter)
class ThresholdSweep(RouterSweep):
    """tau in radians: a threshold on the contribution angle, so the oracle curve comes with it."""

    setting = "tau"
    setting_is_angle = True
    labels = {"threshold": "threshold router (sweep of tau)"}

    @contextmanager
    def sweeping(self, router: ThresholdRouter, value: float) -> Iterator[None]:
        """Evaluate with tau = `value` radians."""
        if value < 0:
            raise ValueError(f"A threshold tau is an angle in radians and cannot be negative; got {value}.")
        trained = router.tau.clone()
        router.tau.fill_(value)
        try:
            yield
        finally:
            router.tau.copy_(trained)

    @torch.no_grad()
    def default_values(self, routers: list[ThresholdRouter], inputs: list[Tensor]) -> list[float]:
        """tau at quantiles of the predicted angles, pooled over the routed sublayers, so the sweep
        spans MoD rates from 0 to about 60%; the first is 0, which skips nothing. (The angle
        predictor's are those of the forward pass that read `inputs`.)"""
        predictions = [r.predict(h) if r.predictor == "probe" else r.last_prediction
                       for r, h in zip(routers, inputs)]
        pooled = torch.cat([p.flatten().float() for p in predictions]).cpu()
        taus = torch.quantile(pooled, torch.tensor(SWEEP_RATE_QUANTILES, dtype=pooled.dtype))
        taus[0] = 0.0
        return sorted({round(t, 6) for t in taus.tolist()})


@sweeps(TopKRouter)
class TopKSweep(RouterSweep):
    """The capacity, evaluated with the exact (non-causal) top-k: analysis only. The first row is
    the causal predictor at the trained capacity, as generation routes."""

    setting = "capacity"
    baseline = "topk_predictor"
    labels = {"topk": "top-k, exact (non-causal, analysis only)",
              "topk_predictor": "top-k, causal predictor (as trained)"}

    @contextmanager
    def sweeping(self, router: TopKRouter, value: float) -> Iterator[None]:
        """Evaluate with the exact top-k at capacity `value`."""
        if not 0 < value <= 1:
            raise ValueError(
                f"A top-k capacity is the fraction of tokens that run each routed sublayer, in (0, 1]; "
                f"got {value}: sweep values in that range."
            )
        trained = router.capacity, router.eval_routing
        router.capacity, router.eval_routing = value, "topk"
        try:
            yield
        finally:
            router.capacity, router.eval_routing = trained

    def default_values(self, routers: list[Router], inputs: list[Tensor]) -> list[float]:
        """Capacities from 1.0 (every token) down to 0.3."""
        return list(SWEEP_CAPACITIES)
