"""Analytic FLOPs of the Transformer from its config and the tokens each sublayer really executed.

DESIGN section 5. A FLOP is one multiply or one add, so a multiply-add counts 2 (the convention of
`torch.utils.flop_counter.FlopCounterMode`, which this count is tested against within 2%). Like
that counter, the count covers matrix products only:

    per token, per executed sublayer       C = d_model, H = cfg.mlp_hidden, V = vocab_size
      attention projections   qkv 2·C·3C + out 2·C·C             = 8·C²
      MLP (SwiGLU)            gate_up 2·C·2H + proj 2·H·C        = 6·C·H
    per sequence, per attention sublayer
      scores and values       2 · K² · C each                    = 4·C·K²   (K: see below)
    per scored token, per routed sublayer
      router                  router.flops_per_token(), in the mode the pass ran in (a router
                              may spend more in training, e.g. the threshold probe runs twice)
    per token
      LM head                 2·C·V
      embedding               0 (a table lookup)
      residual read / write   0 (elementwise: RMSNorm, the NAG rotation, rotary, gating)

Elementwise work is left out on purpose, for every residual strategy alike: per sublayer and token
it is roughly 17·C for NAG's read and write and 7·C for a prenorm add and RMSNorm, about 1% of the
8·C² + 6·C·H of a block's matrix products at C = 64 and less at larger widths, and FlopCounterMode
does not count it either, so leaving it out keeps one definition from the analytic count to the
measurement.

Attention counts the whole block it is given, as FlopCounterMode and torch's FLOP formulas for
the fused kernels count every `scaled_dot_product_attention` call, causal or masked. Dense
attention runs over all T tokens: K = T. Routed attention gathers each sequence's executed tokens
into a padded (B, K, K) block, K = the largest executed count in the batch; under `attend_skipped`
the K queries meet every token's key, a (B, K, T) block, and each skipped token's key and value
projections (4·C²) are counted.
(A causal kernel may skip the masked half in practice.) The causal, unpadded work, n·(n+1)/2
query-key pairs for a sequence of n executed tokens, is reported beside it as `attention_useful`,
for who wants the algorithmic count.

The widths, the sublayer kinds and each sublayer's weights and attention work come from the model
(`TransformerConfig.sublayer_kinds`, `model.SUBLAYER_MODULES`), so the count follows the
architecture instead of restating it; those constants and the formula are `flop_formula`'s,
beside this module.

Training FLOPs are 3 x forward (the backward pass does two matrix products per forward one),
except for routers, which say what their backward costs (`Router.backward_flops_per_token`): a
part that reads a detached input, such as top-k's causal predictor, has no input gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from nag_lightning.model.flop_formula import (  # noqa: F401 - the public names, importable here as before
    TRAINING_MULTIPLIER,
    _Constants,
    _constants,
    _terms,
    head_flops_per_token,
    mod_rate,
    router_backward_flops_per_token,
    router_flops_per_token,
    sublayer_params,
)
from nag_lightning.model.transformer import Transformer, TransformerConfig

# ---------------------------------------------------------------------------------------------------
# The breakdown, for people and tests
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SublayerFlops:
    """Forward FLOPs of one sublayer over one batch.

    Attributes:
        index: sublayer index (block = index // 2).
        kind: "attn" or "mlp".
        executed: tokens that ran the sublayer.
        projections: qkv + out projections (attention) or the SwiGLU matrices (MLP).
        attention: scores and values as computed: the padded K x K block per sequence (0 for MLP).
        attention_useful: scores and values of the causal pairs among executed tokens only.
        router: the router's scoring of every token.
        params: the sublayer's weights (router excluded).
    """

    index: int
    kind: str
    executed: int
    projections: int
    attention: int
    attention_useful: int
    router: int
    params: int

    @property
    def total(self) -> int:
        return self.projections + self.attention + self.router


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs of one batch, in total and per sublayer.

    Attributes:
        tokens: tokens in the batch (B x T).
        forward: all forward FLOPs: sublayers, routers and LM head (embedding 0).
        layers: the sublayers' and routers' share of `forward`.
        full_depth_layers: what the sublayers would cost on this batch at full depth, no router.
        head: the LM head's share of `forward`.
        executed_params: sum over sublayers of weights x tokens that ran them.
        layer_params: weights of all sublayers (what one token meets at full depth).
        sublayers: the per-sublayer breakdown.
        router_backward: what the routers spend in the backward of a training pass.
    """

    tokens: int
    forward: int
    layers: int
    full_depth_layers: int
    head: int
    executed_params: int
    layer_params: int
    sublayers: tuple[SublayerFlops, ...]
    embedding: int = 0
    router_backward: int = 0

    @property
    def training(self) -> int:
        """Forward + backward: 3 x forward, but the routers' backward is their own."""
        router = sum(s.router for s in self.sublayers)
        return TRAINING_MULTIPLIER * (self.forward - router) + router + self.router_backward

    @property
    def executed_fraction(self) -> float:
        """Layer FLOPs executed over layer FLOPs at full depth (routers count as executed)."""
        return self.layers / self.full_depth_layers

    @property
    def executed_params_per_token(self) -> float:
        """Layer weights one token meets on average."""
        return self.executed_params / self.tokens

    @property
    def mod_rate(self) -> float:
        """Fraction of (token, sublayer) executions skipped."""
        return mod_rate(sum(s.executed for s in self.sublayers), self.tokens, len(self.sublayers))

    @property
    def executed_param_fraction(self) -> float:
        """Layer weights one token meets on average over all layer weights."""
        return self.executed_params / (self.tokens * self.layer_params)

    @property
    def attention_useful(self) -> int:
        return sum(s.attention_useful for s in self.sublayers)

    @property
    def attention(self) -> int:
        return sum(s.attention for s in self.sublayers)


def count_flops(
    cfg: TransformerConfig,
    executed: Tensor | Sequence[Sequence[int]],
    seq_len: int,
    router_flops: Sequence[int] | None = None,
    router_backward: Sequence[int] | None = None,
) -> FlopCount:
    """Forward FLOPs of one batch of sequences of `seq_len` tokens.

    Args:
        cfg: the model's architecture.
        executed: (n_sublayers, B) tokens each sublayer executed in each sequence, as a tensor or
            nested lists; a sublayer that ran every token has seq_len in every entry.
        seq_len: T, the tokens per sequence.
        router_flops: each sublayer's router FLOPs per scored token; None asks routers built
            from cfg what they spend in training (`router_flops_per_token`).
        router_backward: each sublayer's router backward FLOPs per scored token in training;
            None asks routers built from cfg when router_flops is None too, else takes two
            matrix products per forward one.
    """
    counts = torch.as_tensor(executed).detach().cpu()
    if counts.ndim != 2 or counts.shape[0] != cfg.n_sublayers:
        raise ValueError(
            f"executed must have shape (n_sublayers={cfg.n_sublayers}, batch); got {tuple(counts.shape)}."
        )
    if (counts < 0).any() or (counts > seq_len).any():
        raise ValueError(f"executed counts must lie in [0, seq_len={seq_len}].")
    if router_flops is None:
        router_flops = router_flops_per_token(cfg)
        router_backward = router_backward_flops_per_token(cfg) if router_backward is None else router_backward
    c = _constants(cfg, router_flops, router_backward=router_backward)
    t = _terms(c, counts, seq_len)
    as_int = lambda x: int(round(float(x)))
    subs = tuple(
        SublayerFlops(
            index=i, kind=kind, executed=as_int(t["executed"][i]),
            projections=as_int(t["projections"][i]), attention=as_int(t["attention"][i]),
            attention_useful=as_int(t["attention_useful"][i]), router=as_int(t["router"][i]),
            params=as_int(c.params[i]),
        )
        for i, kind in enumerate(cfg.sublayer_kinds)
    )
    return FlopCount(
        tokens=as_int(t["tokens"]), forward=as_int(t["forward"]), layers=as_int(t["layers"].sum()),
        full_depth_layers=as_int(t["full_depth"].sum()), head=as_int(t["head"]),
        executed_params=as_int(t["executed_params"].sum()), layer_params=as_int(c.params.sum()),
        sublayers=subs, router_backward=as_int(c.router_backward.sum() * t["tokens"]),
    )


def executed_counts(model: Transformer) -> Tensor:
    """(n_sublayers, B) executed tokens per sublayer per sequence of the model's last forward."""
    sublayers = model.sublayers
    if any(s.executed_per_seq is None for s in sublayers):
        raise RuntimeError("The model has not run a forward pass yet; there is nothing to count.")
    return torch.stack([s.executed_per_seq for s in sublayers])


def count_model(model: Transformer, seq_len: int) -> FlopCount:
    """The breakdown of the model's last forward pass over sequences of `seq_len` tokens. Call it
    with the model in the mode that pass ran in: routers report their cost in their current mode."""
    router_flops = [s.router.flops_per_token() for s in model.sublayers]
    router_backward = [s.router.backward_flops_per_token() for s in model.sublayers]
    return count_flops(model.cfg, executed_counts(model), seq_len, router_flops, router_backward)


def full_depth_forward_flops(cfg: TransformerConfig, seq_len: int | None = None) -> int:
    """Forward FLOPs of one sequence of `seq_len` (default cfg.seq_len) tokens through the
    full-depth, unrouted baseline of `cfg` (same widths, router "none")."""
    T = cfg.seq_len if seq_len is None else seq_len
    counts = torch.full((cfg.n_sublayers, 1), T)
    return count_flops(cfg, counts, T, [0] * cfg.n_sublayers).forward


def reference_training_flops(cfg: TransformerConfig, tokens: int, seq_len: int | None = None) -> int:
    """Training FLOPs the full-depth baseline of `cfg` spends on `tokens` tokens, in sequences of
    `seq_len` (default cfg.seq_len): the budget of an iso-FLOP comparison."""
    T = cfg.seq_len if seq_len is None else seq_len
    return round(TRAINING_MULTIPLIER * full_depth_forward_flops(cfg, T) * tokens / T)


# ---------------------------------------------------------------------------------------------------
# Per-step counts for training: the protocol the accounting callback asks for
# ---------------------------------------------------------------------------------------------------


class StepFlops(NamedTuple):
    """What one training forward pass on one rank did. Fields are numbers or 0-dim tensors (left
    on the device, so counting needs no synchronisation of its own).

    Attributes:
        forward: forward FLOPs of the pass.
        layer: the executed share of it in the model's layers (sublayers, routers).
        full_depth_layer: what those layers would cost on the same batch with every token executing.
        executed_params: sum over layers of their weights x the tokens that ran them.
        tokens: tokens in the batch.
        samples: sequences in the batch.
        training: forward and backward FLOPs of the pass; None means 3 x forward.
    """

    forward: Tensor | float
    layer: Tensor | float
    full_depth_layer: Tensor | float
    executed_params: Tensor | float
    tokens: Tensor | float
    samples: Tensor | float
    training: Tensor | float | None = None


@runtime_checkable
class FlopCounter(Protocol):
    """Counts a model's training forward passes. A LightningModule that is not built on
    `Transformer` plugs into `FlopAccounting` by defining `flop_counter(self) -> FlopCounter`
    (without one it is measured: `nag_lightning.callbacks.measured`).

    `step()` is called after each training batch and describes the last forward pass;
    `full_depth_forward_flops_per_token()` (optional) is what a FLOP budget given as a number of
    tokens of the full-depth baseline multiplies by."""

    def step(self) -> StepFlops: ...


class TransformerFlopCounter:
    """`FlopCounter` of a `Transformer`: reads each sublayer's `executed_per_seq` after the forward.

    A forward pre-hook records the input's sequence length, so it works whatever the batch layout.

    Args:
        model: the model to count.
    """

    def __init__(self, model: Transformer) -> None:
        self.model = model
        self.seq_len: int | None = None
        self._router_flops: list[tuple[int, int]] = []
        self._constants: _Constants | None = None
        self._hook = model.register_forward_pre_hook(self._record)

    def _record(self, module: nn.Module, args: tuple) -> None:
        if module.training:
            self.seq_len = int(args[0].shape[-1])
            # asked here, in the mode of the pass being counted (a router may spend more in training)
            router_flops = [(s.router.flops_per_token(), s.router.backward_flops_per_token())
                            for s in self.model.sublayers]
            if router_flops != self._router_flops:
                self._router_flops, self._constants = router_flops, None

    def step(self) -> StepFlops:
        if self.seq_len is None:
            raise RuntimeError("The model has not run a training forward pass yet.")
        counts = executed_counts(self.model)
        if self._constants is None or self._constants.per_token.device != counts.device:
            forward, backward = zip(*self._router_flops)
            self._constants = _constants(self.model.cfg, forward, counts.device, backward)
        t = _terms(self._constants, counts, self.seq_len)
        return StepFlops(
            forward=t["forward"], layer=t["layers"].sum(), full_depth_layer=t["full_depth"].sum(),
            executed_params=t["executed_params"].sum(), tokens=t["tokens"], samples=t["samples"],
            training=t["training"],
        )

    def full_depth_forward_flops_per_token(self) -> float:
        cfg = self.model.cfg
        return full_depth_forward_flops(cfg) / cfg.seq_len

    def remove(self) -> None:
        """Detach the forward hook."""
        self._hook.remove()


# ---------------------------------------------------------------------------------------------------
# Measuring: FlopCounterMode with the CPU attention kernel counted
# ---------------------------------------------------------------------------------------------------


def _sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Scores q·kᵀ and values p·v over the whole (s_q x s_k) block, as torch counts fused SDPA."""
    b, h, s_q, d_q = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    return 2 * b * h * s_q * s_k * d_q + 2 * b * h * s_q * s_k * d_v


def _sdpa_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                         **kwargs) -> int:
    """The gradients of q, k, v and the probabilities: two matrix products per forward one, what
    math attention's backward runs. (torch's formula for the CUDA kernels adds the recomputation
    of the scores, a fifth product that the kernel's saving of memory costs, not the model.)"""
    return 2 * _sdpa_flops(query_shape, key_shape, value_shape)


def flop_counter_mode(**kwargs: Any):
    """`FlopCounterMode`, plus the formulas of the fused CPU attention kernel, forward and backward,
    with every fused attention backward counted as math attention's.

    torch's registry has FLOP formulas for the CUDA flash / memory-efficient / cuDNN attention
    kernels but not for `_scaled_dot_product_flash_attention_for_cpu` and its backward, so on CPU
    attention would count 0. This adds the formulas torch uses for the CUDA kernels (the whole
    block) and counts its backward as math attention's matrix products, so a measured training
    pass matches the analytic 3 x forward. The CUDA kernels' backward is counted the same way,
    without the recomputation of the scores that torch's formula for them adds.
    """
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    mapping = {aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
               aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_backward_flops,
               aten._scaled_dot_product_flash_attention_backward: _sdpa_backward_flops,
               aten._scaled_dot_product_efficient_attention_backward: _sdpa_backward_flops,
               aten._scaled_dot_product_cudnn_attention_backward: _sdpa_backward_flops}
    mapping.update(kwargs.pop("custom_mapping", {}) or {})
    return FlopCounterMode(display=kwargs.pop("display", False), custom_mapping=mapping, **kwargs)


__all__ = [
    "FlopCount", "FlopCounter", "StepFlops", "SublayerFlops", "TRAINING_MULTIPLIER",
    "TransformerFlopCounter", "count_flops", "count_model", "executed_counts", "flop_counter_mode",
    "full_depth_forward_flops", "head_flops_per_token", "mod_rate", "reference_training_flops",
    "router_backward_flops_per_token", "router_flops_per_token", "sublayer_params",
]
