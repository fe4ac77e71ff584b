"""The FLOP formula of `nag_lightning.model.flops`: each sublayer's constants, asked of the model's
own modules (`SUBLAYER_MODULES[kind].weights` and `.pair_flops`, the router's
`flops_per_token` and `backward_flops_per_token`), and the one formula (`_terms`) that turns the
tokens each sublayer executed into FLOPs, which both the breakdown (`count_flops`) and the
training counter (`TransformerFlopCounter`) use. The conventions are `flops`'s docstring.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from nag_lightning.model.config import TransformerConfig
from nag_lightning.model.sublayer import SUBLAYER_MODULES
from nag_lightning.routers import build_router

TRAINING_MULTIPLIER = 3  # forward + backward (two matrix products per forward one), routers aside


def mod_rate(executed: float, tokens: float, n_sublayers: int) -> float:
    """The MoD rate (DESIGN section 4): skipped (token, sublayer) executions over all of them, of
    the whole model, from the `executed` (token, sublayer) pairs of `tokens` tokens. Routing half
    the sublayers at 25% each is a 12.5% MoD rate."""
    return 1.0 - executed / max(tokens * n_sublayers, 1)


# ---------------------------------------------------------------------------------------------------
# Per-sublayer constants and the one formula both the breakdown and the training callback use
# ---------------------------------------------------------------------------------------------------


def sublayer_params(cfg: TransformerConfig, kind: str) -> int:
    """Weights of one attention (qkv + out) or MLP (gate_up + proj) sublayer; routers not included."""
    return SUBLAYER_MODULES[kind].weights(cfg)


def _per_token(cfg: TransformerConfig, kind: str) -> int:
    """Forward FLOPs per executed token of a sublayer, attention scores and values excluded."""
    return 2 * sublayer_params(cfg, kind)  # each weight is one multiply-add per token


def head_flops_per_token(cfg: TransformerConfig) -> int:
    return 2 * cfg.d_model * cfg.vocab_size


def router_flops_per_token(cfg: TransformerConfig, training: bool = True) -> list[int]:
    """What each sublayer's router spends per scored token in training (or evaluation), asked of
    a router built from `cfg`."""
    return [build_router(cfg.router, cfg.d_model, **cfg.router_options_of(i)).train(training)
            .flops_per_token() if cfg.is_routed(i) else 0 for i in range(cfg.n_sublayers)]


def router_backward_flops_per_token(cfg: TransformerConfig) -> list[int]:
    """What each sublayer's router spends per scored token in the backward of a training pass."""
    return [build_router(cfg.router, cfg.d_model, **cfg.router_options_of(i)).backward_flops_per_token()
            if cfg.is_routed(i) else 0 for i in range(cfg.n_sublayers)]


class _Constants(NamedTuple):
    """Per-sublayer constants as (L,) float64 tensors on one device."""

    per_token: Tensor  # projections + MLP FLOPs per executed token
    attn_coeff: Tensor  # per (query, key) pair: 4·C for attention sublayers, 0 for MLPs; x K² per sequence
    skipped_kv: Tensor  # key and value projections per skipped token (attend_skipped), else 0
    every_key: Tensor  # 1 where executed queries attend to every token (attend_skipped), else 0
    router: Tensor  # router FLOPs per scored token
    router_backward: Tensor  # router backward FLOPs per scored token of a training pass
    params: Tensor  # sublayer weights
    head: float  # LM head FLOPs per token


def _constants(
    cfg: TransformerConfig, router_flops: Sequence[int], device: Any = None,
    router_backward: Sequence[int] | None = None,
) -> _Constants:
    kinds = cfg.sublayer_kinds
    if router_backward is None:  # two matrix products per forward one
        router_backward = [2 * f for f in router_flops]
    if not len(router_flops) == len(router_backward) == len(kinds):
        raise ValueError(
            f"router_flops needs one value per sublayer ({len(kinds)}); got {len(router_flops)}."
        )
    as_t = lambda xs: torch.tensor(xs, dtype=torch.float64, device=device)
    every_key = [cfg.attend_skipped and k == "attn" and cfg.is_routed(i) for i, k in enumerate(kinds)]
    return _Constants(
        per_token=as_t([_per_token(cfg, k) for k in kinds]),
        attn_coeff=as_t([SUBLAYER_MODULES[k].pair_flops(cfg) for k in kinds]),
        skipped_kv=as_t([4 * cfg.d_model ** 2 if every else 0 for every in every_key]),
        every_key=as_t([float(every) for every in every_key]),
        router=as_t(list(router_flops)),
        router_backward=as_t(list(router_backward)),
        params=as_t([sublayer_params(cfg, k) for k in kinds]),
        head=float(head_flops_per_token(cfg)),
    )


def _terms(c: _Constants, counts: Tensor, seq_len: int) -> dict[str, Tensor]:
    """The formula. counts (L, B): tokens each sublayer executed in each sequence of T = seq_len.
    Returns (L,) tensors per sublayer and 0-dim totals, all float64 on counts' device."""
    counts = counts.to(torch.float64)
    B = counts.shape[1]
    executed = counts.sum(1)  # (L,)
    K = counts.amax(1)  # (L,) the padded width attention ran at (T when dense)
    scored = float(B * seq_len)
    projections = c.per_token * executed + c.skipped_kv * (scored - executed)
    # attend_skipped: K queries per sequence against all T keys, and a query at a position p sees
    # p + 1 keys; from counts alone the positions are unknown, so the useful pairs take the mean
    keys = torch.where(c.every_key > 0, K.new_tensor(float(seq_len)), K)
    attention = c.attn_coeff * B * K * keys
    useful = c.attn_coeff / 2 * torch.where(
        c.every_key > 0, executed * (seq_len + 1), (counts * (counts + 1)).sum(1)
    )  # n(n+1)/2 causal pairs x 4C among executed tokens; (T+1)/2 per executed query otherwise
    router = c.router * scored
    full_depth = c.per_token * scored + c.attn_coeff * B * seq_len * seq_len
    layers = projections + attention + router
    head = c.head * scored
    forward = layers.sum() + head
    router_training = router.sum() + c.router_backward.sum() * scored  # routers say their backward
    training = TRAINING_MULTIPLIER * (forward - router.sum()) + router_training
    return {
        "executed": executed, "projections": projections, "attention": attention,
        "attention_useful": useful, "router": router, "layers": layers, "full_depth": full_depth,
        "executed_params": c.params * executed,
        "forward": forward, "training": training, "head": counts.new_tensor(head),
        "tokens": counts.new_tensor(scored), "samples": counts.new_tensor(float(B)),
    }
