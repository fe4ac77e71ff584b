"""LayerNorm Scaling (LNS): pre-norm whose reads shrink with depth, arXiv 2502.05795 (Sun et al.,
"The Curse of Depth in Large Language Models").

The stream is pre-norm's; only the read changes. Both norms of block l (l = 1, 2, ... counts
blocks, not sublayers: the attention and the MLP sublayer of a block share l) scale their output
by 1/sqrt(l), as the paper's reference code does (`1 / sqrt(layer_index + 1)`, layer_index the
0-based block):

    x ──┬────────────────────────────────────────(+)──> x' = x + g·f
        └─> RMSNorm ─> ·γ_i ─> ·1/√l ─> F_i ─> f ┘        l = i // 2 + 1 for sublayer i

The paper's argument: under pre-norm the output variance of a block grows with depth, so deep blocks
become near-identities; scaling the normalized input by 1/sqrt(l) keeps that growth polynomial.
All of the method lives in the residual strategy (the read); the final RMSNorm before the head is
unscaled, as in the paper. The contribution angle and state norm are pre-norm's.
"""

from __future__ import annotations

import math

from torch import Tensor

from nag_lightning.residuals import RESIDUALS, State
from nag_lightning.residuals.prenorm import PreNormResidual


@RESIDUALS.register("lns")
class LayerNormScalingResidual(PreNormResidual):
    """Pre-norm with the read of sublayer i scaled by 1/sqrt(i // 2 + 1) (its 1-based block).

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers that read and write the stream (2 per block).
        eps: RMSNorm epsilon.
    """

    def read(self, state: State, index: int) -> Tensor:
        return super().read(state, index) / math.sqrt(index // 2 + 1)
