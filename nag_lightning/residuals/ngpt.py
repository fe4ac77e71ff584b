"""nGPT: the normalized Transformer, arXiv 2410.01131 (Loshchilov et al., "nGPT: Normalized
Transformer with Representation Learning on the Hypersphere"), after its reference code
(github.com/NVIDIA/ngpt, `model.py` and `normalize_matrices` in `train.py`).

The state is a unit vector; each sublayer moves it a learned per-channel step toward the unit
direction of its output, and the result is projected back onto the sphere:

    e ─> e/|e| ─> x                                                          (|x| = 1)
    x ──┬──────────────────────────────────────────────────────┐
        └─> √d·x·γ_i ─> F_i ─> f ─> f/|f| ─> x + g·|α_i|·(f/|f| - x) ─> /|·| ─> x'
    x_L ─> head ─> ·s_z ─> logits

α_i (d channels, the paper's "eigen learning rates") starts at 0.05 and s_z at 1, both with the
paper's scaling trick: the stored parameter starts at 1/sqrt(d) and is multiplied by
init/(1/sqrt(d)) in the forward pass, so Adam moves it at a rate suited to its size.

What lives here: the state on the sphere (`init_state`, `write`), the eigen learning rates, the
logit scale s_z (`final`), and, through `project_weights`, the renormalization of every weight
matrix along the embedding axis (the embedding and head rows, the rows of matrices that read the
stream, the columns of the output projections that write it), which training applies at the start
of fit and after every optimizer step (`nag_lightning.callbacks.WeightProjection`, added by the
LightningModule on its own when the strategy is nGPT).

What differs from the paper, because it lives inside the sublayers of `model/transformer.py`, shared by every
strategy: q and k are not normalized and scaled by s_qk, the MLP has no s_u/s_v scales, and the
softmax scale stays 1/sqrt(head width). In their place the read hands sublayers sqrt(d)·x times a
learnable per-channel gain γ_i (init 1): with unit-norm weight rows this puts pre-activations on the
scale nGPT's s_v·sqrt(d) gives them. s_z is one scalar, not one per vocabulary entry (a strategy does
not know the vocabulary). nGPT also trains without weight decay and warmup; those are the
LightningModule's settings (`model.weight_decay`, `model.warmup_steps`), left to the recipe. Weight
decay barely matters here: renormalization after each step undoes the shrink it applies.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nag_lightning.residuals import RESIDUALS, ResidualStrategy, State


@torch.no_grad()
def normalize_weight_matrices(model: nn.Module) -> None:
    """Renormalize, in place, every weight matrix of a `Transformer` to unit norm along the
    embedding axis, as nGPT's `normalize_matrices`: rows of the embedding, the head and every
    sublayer matrix that reads the stream; columns of each sublayer's output projection `proj`,
    which writes it. Routers and the strategy's own parameters are left alone."""
    matrices = [(model.embed.weight, 1), (model.head.weight, 1)]
    for sublayer in model.sublayers:
        for module in sublayer.compute.modules():
            if isinstance(module, nn.Linear):
                matrices.append((module.weight, 0 if module is sublayer.compute.proj else 1))
    for weight, dim in matrices:
        weight.copy_(F.normalize(weight.float(), dim=dim).to(weight.dtype))


@RESIDUALS.register("ngpt")
class NGPTResidual(ResidualStrategy):
    """Unit-norm state moved toward each normalized sublayer output by learned per-channel steps.

    Args:
        d_model: width of the residual stream.
        n_sublayers: number of sublayers that read and write the stream.
        alpha_init: initial eigen learning rate of every channel of every sublayer (paper: 0.05).
        alpha_scale: initial value of the stored alpha parameter; None means 1/sqrt(d_model).
        logit_scale_init: initial logit scale s_z (paper: 1).
        logit_scale_scale: initial value of the stored s_z parameter; None means 1/sqrt(d_model).
    """

    def __init__(
        self,
        d_model: int,
        n_sublayers: int,
        alpha_init: float = 0.05,
        alpha_scale: float | None = None,
        logit_scale_init: float = 1.0,
        logit_scale_scale: float | None = None,
    ) -> None:
        super().__init__(d_model, n_sublayers)
        alpha_scale = 1 / math.sqrt(d_model) if alpha_scale is None else alpha_scale
        logit_scale_scale = 1 / math.sqrt(d_model) if logit_scale_scale is None else logit_scale_scale
        if min(alpha_scale, logit_scale_scale) <= 0:
            raise ValueError(
                f"alpha_scale and logit_scale_scale must be positive; got {alpha_scale} and "
                f"{logit_scale_scale}."
            )
        self.alpha_ratio = alpha_init / alpha_scale
        self.logit_scale_ratio = logit_scale_init / logit_scale_scale
        self.alpha = nn.Parameter(torch.full((n_sublayers, d_model), float(alpha_scale)))
        self.logit_scale = nn.Parameter(torch.tensor(float(logit_scale_scale)))
        self.gamma = nn.Parameter(torch.ones(n_sublayers, d_model))

    def init_state(self, embedding: Tensor) -> State:
        return (F.normalize(embedding.float(), dim=-1),)

    def read(self, state: State, index: int) -> Tensor:
        (x,) = state
        return math.sqrt(self.d_model) * x * self.gamma[index]

    def write(
        self, state: State, f: Tensor, gate: Tensor | None, index: int, need_angle: bool = True
    ) -> tuple[State, Tensor | None]:
        (x,) = state
        step = (self.alpha[index] * self.alpha_ratio).abs()  # (d,), as the reference's abs(lr)
        if gate is not None:
            step = gate.unsqueeze(-1).float() * step
        x_new = F.normalize(x + step * (F.normalize(f.float(), dim=-1) - x), dim=-1)
        if gate is not None:  # g = 0 leaves the state exactly as it was, not renormalized
            x_new = torch.where((gate > 0).unsqueeze(-1), x_new, x)
        if not need_angle:
            return (x_new,), None
        with torch.no_grad():
            cos = (x * x_new).sum(-1)
            angle = torch.atan2((x_new - cos.unsqueeze(-1) * x).norm(dim=-1), cos)
            if gate is not None:  # exactly 0, not the rounding of |x| = 1
                angle = torch.where(gate > 0, angle, torch.zeros_like(angle))
        return (x_new,), angle

    def final(self, state: State) -> tuple[Tensor, Tensor | None]:
        (x,) = state
        scale = (self.logit_scale * self.logit_scale_ratio).expand(*x.shape[:-1], 1)
        return x, scale

    def state_norm(self, state: State) -> Tensor:
        (x,) = state
        return x.float().norm(dim=-1)  # 1 by construction: nGPT has no norm lane

    def project_weights(self, model: nn.Module) -> None:
        normalize_weight_matrices(model)
