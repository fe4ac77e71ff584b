"""Top-k Mixture-of-Depths router: Raposo et al. 2024, "Mixture-of-Depths: Dynamically allocating
compute in transformer-based language models", arXiv 2404.02258; used here as the baseline router of
arXiv 2606.16112 (Figliolia & Millidge, "Scaling Adaptive Depth with Norm-Agnostic Residual
Networks"), DESIGN section 4.

Training: a linear score s = <w, h> per token; each sequence keeps its top k = ceil(capacity * T)
tokens, which write with g = sigmoid(s), so the scorer learns through the LM loss.

    h ──> s = <w, h> ──> top-k of the sequence ──> executed, g = sigmoid(s)
    h.detach() ──> MLP ──> p = P(token is in the top k)      (BCE against the top-k membership)

Choosing the top k of a sequence looks at its future tokens, so evaluation and generation cannot
use it. There the small causal predictor routes instead: a token runs when p > 0.5. It reads only
the token's own (detached) input, so it never changes the model, and its agreement with the true
top-k is reported in `stats()`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nag_lightning.routers import ROUTERS, Route, Router

EVAL_ROUTING = ("predictor", "topk")
RAMP_STEPS = 4  # the warm-up ramps capacity in this many equal steps


@ROUTERS.register("topk")
class TopKRouter(Router):
    """Keep the top `capacity` fraction of each sequence's tokens by a learned score.

    Args:
        d_model: width of the sublayer's read input.
        capacity: fraction of each sequence's tokens that run the sublayer, in (0, 1]; the MoD
            rate of the sublayer is 1 - capacity (0.75 gives 25%).
        predictor_hidden: hidden width of the causal predictor MLP used in eval mode.
        eval_routing: "predictor" (causal, the default) routes eval and generation with the
            predictor; "topk" uses the exact, non-causal top-k there too (analysis only).
        full_depth_share: share of training (of its steps, or of its FLOP budget) at the start
            during which every token runs: the skip-rate warm-up (`Router.set_rate_warmup`).
        ramp_share: share of training after that over which the skip rate 1 - capacity rises
            to its target, in four equal steps. The predictor learns the capacity training routes at.
    """

    def __init__(
        self,
        d_model: int,
        capacity: float = 0.75,
        predictor_hidden: int = 64,
        eval_routing: str = "predictor",
        full_depth_share: float = 0.0,
        ramp_share: float = 0.0,
    ) -> None:
        super().__init__(d_model)
        if not 0 < capacity <= 1:
            raise ValueError(
                f"router_options.capacity must be in (0, 1] (the fraction of tokens that run each "
                f"routed sublayer, e.g. 0.75 for a 25% MoD rate); got {capacity}."
            )
        if predictor_hidden < 1:
            raise ValueError(f"router_options.predictor_hidden must be at least 1; got {predictor_hidden}.")
        if eval_routing not in EVAL_ROUTING:
            raise ValueError(
                f"router_options.eval_routing must be one of {EVAL_ROUTING}; got {eval_routing!r}."
            )
        self.capacity = float(capacity)
        self.set_rate_warmup(full_depth_share, ramp_share)
        self.predictor_hidden = predictor_hidden
        self.eval_routing = eval_routing
        self.score = nn.Linear(d_model, 1, bias=False)
        self.predictor = nn.Sequential(
            nn.Linear(d_model, predictor_hidden), nn.SiLU(), nn.Linear(predictor_hidden, 1)
        )
        # h has per-channel scale ~1, so this starts s at ~N(0, 0.1^2): gates near 0.5, ranks random.
        nn.init.normal_(self.score.weight, std=0.1 / math.sqrt(d_model))
        self._stats: dict[str, Tensor] = {}

    def forward(self, h: Tensor) -> Route:
        B, T, _ = h.shape
        s = self.score(h).squeeze(-1)  # (B, T)
        logit = self.predictor(h.detach()).squeeze(-1)  # (B, T), causal: one token at a time
        capacity = self.capacity
        if self.training:  # the warm-up's share of the skip rate 1 - capacity (`Router.set_progress`)
            # in quarters: k is a Python number, and a compiled model keeps one graph per k
            capacity = 1.0 - (1.0 - capacity) * math.floor(self.rate_scale * RAMP_STEPS + 1e-9) / RAMP_STEPS
        k = math.ceil(capacity * T)
        top = s.detach().topk(k, dim=1).indices.sort(dim=1).values  # (B, k) positions, in order
        in_topk = torch.zeros_like(s, dtype=torch.bool).scatter_(1, top, True)  # (B, T)
        positions = None
        if self.training or self.eval_routing == "topk":
            executed, positions = in_topk, top  # k from every sequence: gathered with static shapes
        else:
            executed = logit > 0  # sigmoid(logit) > 0.5
        if self.training:
            self.aux_loss = F.binary_cross_entropy_with_logits(logit, in_topk.to(logit.dtype))
        else:
            self.aux_loss = h.new_zeros((), dtype=torch.float)
        with torch.no_grad():
            self._stats = {
                "predictor_loss": self.aux_loss.detach(),
                "predictor_agreement": ((logit > 0) == in_topk).float().mean(),
            }
        if k == T and executed is in_topk:
            return Route(executed=None, gate=torch.sigmoid(s))  # every token runs: no gather
        return Route(executed=executed, gate=torch.sigmoid(s), positions=positions)

    @property
    def causal(self) -> bool:
        """In eval mode the predictor decides per token; the exact top-k reads the whole sequence."""
        return self.eval_routing == "predictor"

    def use_causal(self) -> Callable[[], None] | None:
        """Route eval mode with the predictor, whatever `eval_routing` says."""
        if self.eval_routing == "predictor":
            return None
        trained, self.eval_routing = self.eval_routing, "predictor"

        def restore() -> None:
            self.eval_routing = trained

        return restore

    def observe(self, h: Tensor, route: Route, contribution: Tensor | None) -> None:
        """The predictor's loss is set in `forward`; top-k learns nothing from the angle."""

    def flops_per_token(self) -> int:
        """Score <w, h> plus the predictor MLP, which runs in training (for its loss) and eval."""
        d, hidden = self.d_model, self.predictor_hidden
        return 2 * d + 2 * (d * hidden + hidden)

    def backward_flops_per_token(self) -> int:
        """The score's two gradients; the predictor's first layer reads a detached input, so only
        its weights' gradient; its second layer both (its input is the trained first layer's)."""
        d, hidden = self.d_model, self.predictor_hidden
        return 2 * (2 * d) + 2 * d * hidden + 2 * (2 * hidden)

    def stats(self) -> dict[str, float]:
        """Predictor BCE and its agreement with the true top-k on the last forward pass."""
        return {"capacity": self.capacity, **{k: v.item() for k, v in self._stats.items()}}
