"""The depth map of a text: for every token and sublayer, the angle by which the sublayer turned
the token's state direction, the sublayer's bound on that angle, and whether the token ran it.

This is the paper's interpretable adaptive depth (arXiv 2606.16112, claim 5) on one's own text:
the angle is the residual strategy's `contribution` (DESIGN section 3), in radians, recorded by
each `Sublayer` during one forward pass; a skipped token is not turned (angle 0). The model routes
as it does in evaluation and generation, each router on its causal decision
(`generate.use_causal_routing`), so `executed` is what the model's router decides for that token.

The bound is what a residual strategy says through `AngleBound`, a protocol of this tool alone:
NAG bounds each sublayer's angle (`bound_of`); residuals without a bound (pre-norm, Peri-LN,
LNS, nGPT) have NaN there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from nag_lightning.data.tokenizer import Tokenizer
from nag_lightning.model import Transformer


@runtime_checkable
class AngleBound(Protocol):
    """A residual strategy whose sublayers turn a token by at most a known angle."""

    def bound_of(self, index: int) -> float | Tensor:
        """Sublayer `index`'s bound on the angle, in radians."""
        ...


@dataclass(frozen=True)
class DepthMap:
    """How far each token turned in each sublayer, and which sublayers it ran.

    Attributes:
        tokens: the T tokens of the text, each as its text (bytes that are not UTF-8 of their own,
            such as part of a character, as \\x escapes).
        sublayers: the S sublayers in the order the stream runs them: "0.attn", "0.mlp", "1.attn", ...
        angle: (T, S) radians by which sublayer s turned token t's state direction (0 where skipped).
        bound: (S,) radians, the most sublayer s may turn a token by; NaN for a residual
            strategy without a bound.
        executed: (T, S) whether token t ran sublayer s under the model's router.
    """

    tokens: list[str]
    sublayers: list[str]
    angle: Tensor
    bound: Tensor
    executed: Tensor

    @property
    def mod_rate(self) -> float:
        """The share of (token, sublayer) executions skipped."""
        return 1.0 - self.executed.float().mean().item()

    def table(self) -> str:
        """The map as text: a row per token, a column per sublayer, the angle in degrees and '-'
        for a skipped sublayer."""
        width = max(7, *(len(name) for name in self.sublayers))
        head = f"{'token':<10}" + "".join(f"{name:>{width}}" for name in self.sublayers)
        rows = [head]
        for t, token in enumerate(self.tokens):
            cells = [f"{math.degrees(a):>{width}.1f}" if ran else f"{'-':>{width}}"
                     for a, ran in zip(self.angle[t].tolist(), self.executed[t].tolist())]
            rows.append(f"{token!r:<10}"[:10] + "".join(cells))
        bounds = [f"{math.degrees(b):>{width}.1f}" for b in self.bound.tolist()]
        rows.append(f"{'bound':<10}" + "".join(bounds))
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


def token_texts(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each token of `ids` as its text; bytes that are not UTF-8 on their own as \\x escapes."""
    return [tokenizer.token_bytes[i].decode("utf-8", errors="backslashreplace") for i in ids]


def sublayer_bounds(model: Transformer) -> Tensor:
    """(S,) each sublayer's bound on its angle in radians (`AngleBound`), NaN without one."""
    strategy = model.strategy
    if not isinstance(strategy, AngleBound):
        return torch.full((len(model.sublayers),), math.nan)
    return torch.tensor([float(strategy.bound_of(s.index)) for s in model.sublayers])


@torch.no_grad()
def depth_map(model: Transformer, tokenizer: Tokenizer, text: str) -> DepthMap:
    """The `DepthMap` of `text` (its UTF-8 bytes encoded with `tokenizer`) under `model`, which
    routes as it is set up (eval mode and causal routing: `generate.use_causal_routing`); one
    sentence for an empty text or one longer than the model's context."""
    ids = tokenizer.encode(text.encode("utf-8")).tolist()
    if not ids:
        raise ValueError("The text is empty; give at least one character to map.")
    if len(ids) > model.cfg.seq_len:
        raise ValueError(
            f"The text is {len(ids)} tokens long, more than the model's context of "
            f"{model.cfg.seq_len} (model.arch.seq_len); give a shorter text."
        )
    device = model.head.weight.device
    model.record_diagnostics(True)
    try:
        model(torch.tensor([ids], device=device))
        angle = torch.stack([s.contribution[0].float().cpu() for s in model.sublayers], dim=1)
        executed = torch.stack([s.executed[0].cpu() for s in model.sublayers], dim=1)
    finally:
        model.record_diagnostics(False)
    return DepthMap(
        tokens=token_texts(tokenizer, ids),
        sublayers=[f"{s.index // 2}.{s.kind}" for s in model.sublayers],
        angle=angle,
        bound=sublayer_bounds(model),
        executed=executed.bool(),
    )
