"""Residual strategies: how a token's state is started, read by a sublayer, written, and read out.

The model never touches the residual state itself. It asks the strategy to:

    state = init_state(embedding)             start the stream from the token embedding
    h     = read(state, i)                    the input sublayer i sees, shape (..., d)
    state, angle = write(state, f, g, i)      fold the sublayer output f back in, gated by g
    angle = planned_angle(state, i)           optional: the angle the write will turn by, before
                                              the sublayer runs (NAG's gated angle); None if unknown
    loss = aux_loss()                         optional: a training loss of the last pass, or None
    feats, scale = final(state)               features for the LM head and an optional logit scale

A state is a tuple of tensors whose leading dimensions index tokens, so the sublayer wrapper can
gather the tokens a router executes, write only those, and scatter them back without the strategy
knowing. `write` also returns the sublayer's `contribution`: the angle, in radians, by which it turned
each token's state direction (DESIGN section 3), the number depth diagnostics and routers reason in.

Adding a strategy takes one file in this folder: subclass `ResidualStrategy`, decorate it with
`@RESIDUALS.register("name")`; every module here is imported below, so it is registered on import.
"""

from __future__ import annotations

import importlib
import pkgutil

from torch import Tensor, nn

from nag_lightning.registry import Registry

State = tuple[Tensor, ...]


class ResidualStrategy(nn.Module):
    """Base class of residual strategies. Owns the per-sublayer read gains and write scalars.

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers that read and write the stream (2 per block).
    """

    def __init__(self, d_model: int, n_sublayers: int) -> None:
        super().__init__()
        self.d_model = d_model
        self.n_sublayers = n_sublayers

    def init_state(self, embedding: Tensor) -> State:
        """Start the stream from token embeddings of shape (..., d)."""
        raise NotImplementedError

    def read(self, state: State, index: int) -> Tensor:
        """The input of sublayer `index`, shape (..., d)."""
        raise NotImplementedError

    def write(
        self, state: State, f: Tensor, gate: Tensor | None, index: int, need_angle: bool = True
    ) -> tuple[State, Tensor | None]:
        """Fold sublayer output `f` (..., d) in, gated per token by `gate` (...) in [0, 1] or None
        (= 1). Returns the new state and the contribution angle (...) in radians, detached; a
        strategy for which the angle costs extra work may return None when `need_angle` is False."""
        raise NotImplementedError

    def planned_angle(self, state: State, index: int) -> Tensor | None:
        """The angle (...) in radians by which `write` will turn each token at gate 1, when the
        strategy knows it before sublayer `index` runs (then a router may skip on it, without a
        predictor), with its gradient to the gate (a router may price it; decisions detach it);
        None (the default) when only the write tells."""
        return None

    @property
    def plans_angle(self) -> bool:
        """Whether `planned_angle` gives the angle, so a router may read it: by default, whether
        the strategy defines `planned_angle`; a strategy that does so only in some settings says."""
        return type(self).planned_angle is not ResidualStrategy.planned_angle

    def aux_loss(self) -> Tensor | None:
        """A loss term the strategy adds to training from its last forward pass (NAG's angle
        cost), or None (the default): the model adds it to the routers' auxiliary losses."""
        return None

    def final(self, state: State) -> tuple[Tensor, Tensor | None]:
        """Features (..., d) for the LM head and a per-token logit scale (..., 1), or None. The
        head has no bias, so the model multiplies the features by the scale, the narrower of the
        two wherever d < vocab."""
        raise NotImplementedError

    def state_norm(self, state: State) -> Tensor:
        """A per-token norm of the state (...) comparable across depth, for diagnostics."""
        raise NotImplementedError

    def project_weights(self, model: nn.Module) -> None:
        """Constrain the weights of `model` (the whole Transformer) in place, as the strategy's
        method requires; training calls it at the start of fit and after every optimizer step.
        Nothing by default; nGPT keeps every weight matrix unit-norm along the embedding axis."""

    @property
    def training_callbacks(self) -> tuple[str, ...]:
        """Class paths of the Lightning callbacks the strategy's method needs in training, which
        the LightningModule adds on its own: by default weight projection for a strategy that
        overrides `project_weights`, else none. Paths, not classes, so the model needs no
        Lightning."""
        if type(self).project_weights is ResidualStrategy.project_weights:
            return ()
        return ("nag_lightning.callbacks.WeightProjection",)


RESIDUALS: Registry[ResidualStrategy] = Registry("residual strategy", "nag_lightning.residuals")


def build_residual(
    spec: str | dict, d_model: int, n_sublayers: int, **options: object
) -> ResidualStrategy:
    """Build a strategy from a YAML spec (a registered name or `{class_path, init_args}`); `options`
    override the spec's init_args."""
    cls, init_args = RESIDUALS.resolve(spec)
    options = {**init_args, **options}
    RESIDUALS.check_options(cls, options, ("d_model", "n_sublayers"), "model.arch.residual_options")
    return cls(d_model=d_model, n_sublayers=n_sublayers, **options)


def radial_split(f: Tensor, direction: Tensor) -> tuple[Tensor, Tensor]:
    """Split f into its component `a` along a unit `direction` (...) and the rest `f_perp` (..., d)."""
    a = (f * direction).sum(-1)
    return a, f - a.unsqueeze(-1) * direction


for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["RESIDUALS", "ResidualStrategy", "State", "build_residual", "radial_split"]
