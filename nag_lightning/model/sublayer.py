"""The sublayers of a block and the wrapper every one of them runs through (`Sublayer`): read,
route, compute the executed tokens, write. The MLP (`SwiGLU`) is here; attention is `attention`'s.
Shapes: B batch, T sequence, C = d_model, K executed tokens of the longest sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nag_lightning.model.attention import Attention
from nag_lightning.model.config import TransformerConfig
from nag_lightning.model.kv_cache import CachedPass
from nag_lightning.residuals import ResidualStrategy, State
from nag_lightning.routers import Route, Router


class SwiGLU(nn.Module):
    """MLP: proj(silu(x W1) * x W3), no biases."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.mlp_hidden, bias=False)
        self.proj = nn.Linear(cfg.mlp_hidden, cfg.d_model, bias=False)

    @staticmethod
    def weights(cfg: TransformerConfig) -> int:
        """Weights of one MLP sublayer: gate_up (C, 2H) and proj (H, C)."""
        return 3 * cfg.d_model * cfg.mlp_hidden

    @staticmethod
    def pair_flops(cfg: TransformerConfig) -> int:
        """An MLP's tokens do not attend: no work per (query, key) pair."""
        return 0

    def forward(self, h: Tensor) -> Tensor:
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


SUBLAYER_MODULES: dict[str, type[Attention] | type[SwiGLU]] = {"attn": Attention, "mlp": SwiGLU}
"""The module of each sublayer kind; each says its own weights and attention work (`flops`)."""


class Sublayer(nn.Module):
    """read -> route -> compute the executed tokens -> write, for one attention or MLP sublayer.

    After each forward it holds, detached, what accounting and diagnostics read: `executed_per_seq`
    (B,) executed tokens of each sequence, and, when `record` is set, `contribution` (B, T) and
    `state_norm` (B, T) after the write, `executed` (B, T) which tokens ran, and `planned_angle`
    (B, T) the strategy's angle before the sublayer ran (None when it has none).
    """

    def __init__(self, kind: str, index: int, compute: nn.Module, router: Router) -> None:
        super().__init__()
        self.kind = kind
        self.index = index
        self.compute = compute
        self.router = router
        self.record = False
        self.executed_per_seq: Tensor | None = None
        self.contribution: Tensor | None = None
        self.state_norm: Tensor | None = None
        self.executed: Tensor | None = None
        self.planned_angle: Tensor | None = None

    @property
    def routed(self) -> bool:
        """Whether this sublayer's router may skip tokens."""
        return self.router.routes

    def forward(self, state: State, strategy: ResidualStrategy, cached: CachedPass | None = None) -> State:
        """The sublayer over the whole sequence, or, with `cached`, over new tokens only: attention
        then reads and extends the KV cache, padding executes nothing, the router only decides
        (nothing is learned or recorded), and a sublayer no token runs costs nothing."""
        # (B, T, C); cast for models held in low precision while the state lanes stay fp32
        h = strategy.read(state, self.index).to(self.compute.proj.weight.dtype)
        planned = None
        if self.router.reads_planned_angle or (self.record and cached is None):
            # in fp32 from the fp32 state, also under autocast: in bf16 the angles of a model
            # whose gate has not spread them yet fall on a few values, and a router splitting
            # them at a quantile then finds nothing to skip
            with torch.autocast(h.device.type, enabled=False):
                planned = strategy.planned_angle(state, self.index)
        if self.router.reads_planned_angle:
            route: Route = self.router(h, planned_angle=planned)
        else:
            route = self.router(h)
        if cached is not None:
            return self._run_cached(state, strategy, h, route, cached)
        need_angle = self.record or self.router.needs_contribution
        executed = route.executed
        if executed is None:
            state, angle = strategy.write(state, self.compute(h), route.gate, self.index, need_angle)
            self.executed_per_seq = torch.full(h.shape[:1], h.shape[1], device=h.device)
        else:
            state, angle = self._run_routed(state, strategy, h, route, need_angle)
        self.router.observe(h, route, angle)
        if self.record:
            self.contribution = angle
            self.state_norm = strategy.state_norm(state).detach()
            every = executed is None
            self.executed = torch.ones(h.shape[:2], dtype=torch.bool, device=h.device) if every else executed
            self.planned_angle = None if planned is None else planned.detach()
        return state

    def _run_routed(
        self, state: State, strategy: ResidualStrategy, h: Tensor, route: Route, need_angle: bool
    ) -> tuple[State, Tensor | None]:
        """Training and evaluation with skipped tokens: the executed tokens' rows of h and of the
        state lanes are gathered, the sublayer computes them, the write turns them, and they are
        copied back into the lanes; skipped tokens' state is the same tensor entries, untouched.
        Rows are flat indices into (B * T) (`index_select` / `index_copy`, whose backwards are an
        `index_add` and a gather: one pass each over the executed rows, where indexing by
        (b, t) pairs adds a serial accumulating `index_put` to the backward, and writing every
        token with f = 0 where skipped costs a full write, forward and backward, plus a select
        over each lane; docs/benchmarks.md, "MoD that saves time"). Where every sequence executes
        the same number K of tokens (top-k's `route.positions`, (B, K)) the rows and shapes are
        static; otherwise they come from the mask."""
        executed = route.executed
        B, T = executed.shape
        at = route.positions
        every_key = self.kind == "attn" and self.compute.attend_skipped  # skipped tokens offer k, v
        if at is not None:
            rows = (at + T * torch.arange(B, device=at.device).unsqueeze(1)).flatten()  # (B * K,)
            picked = h.flatten(0, 1).index_select(0, rows).view(B, at.shape[1], -1)  # (B, K, C)
            if every_key:
                f = self.compute.forward_every_key(h, at)
            else:
                f = self.compute(picked, at) if self.kind == "attn" else self.compute(picked)
            f = f.flatten(0, 1)  # (B * K, C)
            self.executed_per_seq = torch.full((B,), at.shape[1], device=h.device)
        else:
            b, t = executed.nonzero(as_tuple=True)  # (N,) each, sorted by (b, t)
            rows = b * T + t  # (N,), increasing
            picked = h.flatten(0, 1).index_select(0, rows)  # (N, C)
            if every_key:
                f = self.compute.forward_every_key_masked(h, b, t, executed)
            elif self.kind == "attn":
                f = self.compute.forward_routed(picked, b, t, executed)
            else:
                f = self.compute(picked)
            self.executed_per_seq = executed.sum(1)
        lanes = tuple(lane.flatten(0, 1) for lane in state)  # (B * T, ...) each
        gate = None if route.gate is None else route.gate.flatten().index_select(0, rows)
        written, angle = strategy.write(tuple(lane.index_select(0, rows) for lane in lanes), f, gate,
                                        self.index, need_angle)
        # A strategy returns its lanes' own dtypes; the cast only guards one that follows f's
        # (bf16 under autocast), since index_copy refuses mixed dtypes.
        state = tuple(lane.index_copy(0, rows, new.to(lane.dtype)).view_as(old)
                      for lane, new, old in zip(lanes, written, state))
        if angle is not None:  # a skipped token is not turned at all
            angle = angle.new_zeros(B * T).index_copy(0, rows, angle).view(B, T)
        return state, angle

    def _run_cached(
        self, state: State, strategy: ResidualStrategy, h: Tensor, route: Route, cached: CachedPass
    ) -> State:
        """New tokens of generation: the executed ones run the sublayer, attention through the KV
        cache; their state rows are gathered, written and put back, and no write runs where no
        token executes (a step of generation is often one token). Under `attend_skipped` every
        real token's key and value enter the cache (their queries run too; the outputs of skipped
        tokens are dropped)."""
        executed = cached.executes(route.executed)
        if executed is None:
            if self.kind == "attn":
                f = self.compute.forward_cached(h, cached.positions, cached.caches[self.index])
            else:
                f = self.compute(h)
            return strategy.write(state, f, route.gate, self.index, False)[0]
        every_key = self.kind == "attn" and self.compute.attend_skipped
        if every_key:  # every real token writes its key and value; the executed ones keep their output
            real = torch.ones_like(executed) if cached.valid is None else cached.valid
            rb, rt = real.nonzero(as_tuple=True)
            f_real = self.compute.forward_cached_routed(
                h[rb, rt], rb, rt, real, cached.positions[rb, rt], cached.caches[self.index]
            )
            f_every = h.new_zeros(h.shape, dtype=f_real.dtype).index_put((rb, rt), f_real)
        b, t = executed.nonzero(as_tuple=True)  # (N,) each, sorted by (b, t)
        if b.numel() == 0:
            return state
        picked = tuple(lane[b, t] for lane in state)
        picked_h = h[b, t]  # (N, C)
        if every_key:
            f = f_every[b, t]
        elif self.kind == "attn":
            f = self.compute.forward_cached_routed(
                picked_h, b, t, executed, cached.positions[b, t], cached.caches[self.index]
            )
        else:
            f = self.compute(picked_h)
        gate = None if route.gate is None else route.gate[b, t]
        written, _ = strategy.write(picked, f, gate, self.index, False)
        # A strategy returns its lanes' own dtypes; the cast only guards one that follows f's
        # (bf16 under autocast), since index_put refuses mixed dtypes.
        return tuple(lane.index_put((b, t), new.to(lane.dtype)) for lane, new in zip(state, written))


def merge(state: State, written: State, keep: Tensor) -> State:
    """The state after a write: each lane (B, T, ...) as `written` where `keep` (B, T), as it was
    elsewhere. The cast only guards a strategy whose lanes follow f's dtype (bf16 under autocast)."""
    return tuple(
        torch.where(keep.view(*keep.shape, *[1] * (old.dim() - keep.dim())), new.to(old.dtype), old)
        for new, old in zip(written, state)
    )


class Block(nn.Module):
    """One attention and one MLP sublayer (the unit FSDP wraps)."""

    def __init__(self, attn: Sublayer, mlp: Sublayer) -> None:
        super().__init__()
        self.attn = attn
        self.mlp = mlp

    def forward(self, state: State, strategy: ResidualStrategy, cached: CachedPass | None = None) -> State:
        if cached is None:  # training and evaluation: no cache to pass
            return self.mlp(self.attn(state, strategy), strategy)
        return self.mlp(self.attn(state, strategy, cached), strategy, cached)
