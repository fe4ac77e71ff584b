"""Peri-LN: a norm on both sides of every sublayer, arXiv 2502.02732 (Kim et al., "Peri-LN:
Revisiting Normalization Layer in the Transformer Architecture").

Pre-norm's stream, with the sublayer's output RMS-normalized (its own learnable gain) before it is
added, and the embedding normalized before the first block:

    e ─> RMSNorm ─> ·γ_emb ─> x
    x ──┬─────────────────────────────────────────────────────────(+)──> x' = x + g·f̂
        └─> RMSNorm ─> ·γ_in,i ─> F_i ─> f ─> RMSNorm ─> ·γ_out,i ─> f̂ ┘
    x_L ─> RMSNorm ─> ·γ_final ─> head

Every update has the RMS of its gain (1 at init) whatever F_i produced, so the stream's variance
grows at most linearly with depth instead of through the sublayers' own growth, the "massive
activations" the paper attributes to pre-norm. All of the method lives in the residual strategy
(embedding norm in `init_state`, output norm in `write`, final norm in `final`); gains start at 1.
The contribution angle and state norm are pre-norm's, measured on the normalized update.

`tangential: true` is an ablation on the way to NAG, not a variant to train with: the normalized
update loses its part along the stream, x' = x + g·f̂ - <g·f̂, x̂>·x̂, so every write turns the
stream in the plane of its update by atan(|g·f̂⊥| / |x|) and the norm grows only by the turn
(|x'|² = |x|² + |g·f̂⊥|²), a deterministic slowing like NAG's decaying bound at the gate's start.
What it keeps of Peri-LN measures what NAG's gate, norm lane and readout lose
(docs/results_tasks.md, the diagnosis).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nag_lightning.residuals import RESIDUALS, State
from nag_lightning.residuals.prenorm import PreNormResidual


@RESIDUALS.register("periln")
class PeriLNResidual(PreNormResidual):
    """x' = x + g·RMSNorm(F(RMSNorm(x))), the embedding normalized, a final RMSNorm.

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers that read and write the stream.
        eps: RMSNorm epsilon.
        tangential: drop the normalized update's part along the stream (an ablation; see above).
    """

    def __init__(self, d_model: int, n_sublayers: int, eps: float = 1e-6, tangential: bool = False) -> None:
        super().__init__(d_model, n_sublayers, eps)
        if not isinstance(tangential, bool):
            raise ValueError(f"tangential must be true or false; got {str(tangential)[:40]}.")
        self.tangential = tangential
        self.gamma_post = nn.Parameter(torch.ones(n_sublayers, d_model))
        self.gamma_embed = nn.Parameter(torch.ones(d_model))

    def init_state(self, embedding: Tensor) -> State:
        return (F.rms_norm(embedding, (self.d_model,), self.gamma_embed, self.eps),)

    def write(
        self, state: State, f: Tensor, gate: Tensor | None, index: int, need_angle: bool = True
    ) -> tuple[State, Tensor | None]:
        # fp32: the sublayer may run in bf16, and the norm's statistics should not.
        f = F.rms_norm(f.float(), (self.d_model,), self.gamma_post[index], self.eps)
        if self.tangential:
            (x,) = state
            direction = F.normalize(x.float(), dim=-1)
            f = f - (f * direction).sum(-1, keepdim=True) * direction
        return super().write(state, f, gate, index, need_angle)
