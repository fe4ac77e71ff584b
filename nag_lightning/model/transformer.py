"""Decoder-only byte-level Transformer whose residual stream and routing are plugins.

Plain `torch.nn`, single device, no Lightning. Every attention and MLP sublayer goes through the
same `Sublayer` wrapper:

    state ─> strategy.read ─> h ─> router ─> Route(executed, gate)
                                             │
        gather executed tokens' h ─> attention / MLP on them alone ─> scatter ─> f (0 if skipped)
                                             │
    state' <─ kept where executed <─ strategy.write(state, f, gate (0 if skipped)) ┘

so a residual strategy never sees routing and a router never sees the residual state. Generation
runs the same path over new tokens only (`stream(idx, cached)`), writing the executed tokens' rows
alone: attention then reads and extends the KV cache of its executed tokens (`kv_cache`, driven
by `inference`, beside this module).
Shapes: B batch, T sequence, C = d_model, N executed tokens, K executed tokens of the longest
sequence (the padded width routed attention runs at), H heads, D head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from nag_lightning.model.kv_cache import CachedPass, KVCache
from nag_lightning.model.limits import check_size
from nag_lightning.residuals import ResidualStrategy, State, build_residual
from nag_lightning.routers import Route, Router, build_router

SUBLAYER_KINDS = ("attn", "mlp")  # the sublayers of every block, in order


RESUMABLE_CHANGES = ("seq_len", "residual_options", "router_options", "init_std", "embed_std", "rope_base",
                     "activation_checkpointing")
"""The settings a run may resume with changed: the checkpoint's weights fit either way."""


@dataclass
class TransformerConfig:
    """Architecture of the model: `model.arch` in YAML and on the command line, the one place its
    settings are written. Every field is validated with a sentence that says how to fix it.

    Attributes:
        vocab_size: number of token ids (256 for bytes); the command line sets it from
            data.tokenizer.
        d_model: residual width C.
        n_layers: number of blocks (each an attention and an MLP sublayer).
        n_heads: attention heads; must divide d_model.
        mlp_ratio: SwiGLU hidden width over d_model.
        seq_len: longest sequence the rotary tables cover (the data module reads the same value).
        residual: residual strategy: "nag", "prenorm", another registered name, or the dotted
            class path of a strategy in any importable module.
        residual_options: keyword options of the residual strategy (e.g. theta_max, kernel).
        router: router: "none", "topk", "threshold", another registered name, or the dotted class
            path of a router in any importable module.
        router_options: keyword options of the router (e.g. capacity, tau, target_rate).
        route_kinds: which sublayer kinds are routed: "attn", "mlp" or both.
        route_layers: which blocks are routed: "all", "every_other" (1, 3, 5, ...) or a list of
            block indices.
        init_std: standard deviation of linear weights at init; null means 1/sqrt(d_model). GPT-2's
            0.02 suits width 768; at width 64 it is 6x too small, and both residuals trained 0.3-0.55
            bits per byte worse under it (docs/results_history.md, section 0).
        embed_std: standard deviation of the token embedding at init.
        rope_base: rotary embedding base.
        activation_checkpointing: keep only each block's input in training and run its forward
            again during backward (`torch.utils.checkpoint`), trading that compute for the
            activation memory of every block.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: float = 4.0
    seq_len: int = 256
    residual: str = "nag"
    residual_options: dict = field(default_factory=dict)
    router: str = "none"
    router_options: dict = field(default_factory=dict)
    route_kinds: list[str] = field(default_factory=lambda: list(SUBLAYER_KINDS))
    route_layers: str | list[int] = "all"
    init_std: float | None = None
    embed_std: float = 1.0
    rope_base: float = 10000.0
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        check_size(self)  # before anything is built: sizes from a file may be any number
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.arch.{name} must be at least 1; got {getattr(self, name)}.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.arch.d_model ({self.d_model}) must be divisible by model.arch.n_heads "
                f"({self.n_heads}); change one of them."
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"The head width d_model / n_heads = {self.d_model // self.n_heads} must be even "
                "for rotary embeddings; change model.arch.d_model or model.arch.n_heads."
            )
        if self.seq_len < 2:
            raise ValueError(
                f"model.arch.seq_len must be at least 2 (one input and one target); got {self.seq_len}."
            )
        if self.init_std is not None and self.init_std <= 0:
            raise ValueError(
                f"model.arch.init_std must be positive, or null for 1/sqrt(d_model); got {self.init_std}."
            )
        if self.mlp_ratio <= 0:
            raise ValueError(f"model.arch.mlp_ratio must be positive; got {self.mlp_ratio}.")
        if not self.rope_base > 0:
            raise ValueError(f"model.arch.rope_base must be positive (10000 is usual); got {self.rope_base}.")
        for kind in ("residual", "router"):
            if not isinstance(getattr(self, kind), str):
                raise ValueError(
                    f"model.arch.{kind} is a registered name or a dotted class path, with its options "
                    f"in model.arch.{kind}_options; got {getattr(self, kind)!r}."
                )
        unknown = set(self.route_kinds) - set(SUBLAYER_KINDS)
        if unknown:
            raise ValueError(
                f"model.arch.route_kinds names sublayer kinds {sorted(unknown)} that do not exist; "
                f"choose from {list(SUBLAYER_KINDS)}."
            )
        self.routed_layers()  # validates route_layers

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layers

    @property
    def sublayer_kinds(self) -> list[str]:
        """The kind of every sublayer in order: block index // 2, attention first."""
        return list(SUBLAYER_KINDS) * self.n_layers

    @property
    def mlp_hidden(self) -> int:
        """The SwiGLU hidden width H."""
        return int(self.mlp_ratio * self.d_model)

    def routed_layers(self) -> set[int]:
        """The block indices whose sublayers of `route_kinds` are routed."""
        if self.route_layers == "all":
            return set(range(self.n_layers))
        if self.route_layers == "every_other":
            return set(range(1, self.n_layers, 2))
        if isinstance(self.route_layers, str) or any(
            not 0 <= i < self.n_layers for i in self.route_layers
        ):
            raise ValueError(
                f"model.arch.route_layers must be 'all', 'every_other' or a list of block indices in "
                f"[0, {self.n_layers}); got {self.route_layers!r}."
            )
        return set(self.route_layers)

    def is_routed(self, index: int) -> bool:
        """Whether sublayer `index` (block index // 2, attention first) gets the router."""
        return index // 2 in self.routed_layers() and self.sublayer_kinds[index] in self.route_kinds


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) for any positions, including gathered ones."""

    def __init__(self, head_dim: int, seq_len: int, base: float) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq_len).float(), inv_freq)  # (seq_len, D/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (..., P, H, D) at integer positions (..., P)."""
        cos = self.cos[positions].unsqueeze(-2).to(x.dtype)  # (..., P, 1, D/2)
        sin = self.sin[positions].unsqueeze(-2).to(x.dtype)
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    """Causal multi-head attention through `scaled_dot_product_attention`, no biases."""

    def __init__(self, cfg: TransformerConfig, rotary: Rotary) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rotary = [rotary]  # shared with the other blocks; a list keeps it out of this module

    @staticmethod
    def weights(cfg: TransformerConfig) -> int:
        """Weights of one attention sublayer: qkv (C, 3C) and proj (C, C)."""
        return 4 * cfg.d_model * cfg.d_model

    @staticmethod
    def pair_flops(cfg: TransformerConfig) -> int:
        """FLOPs per (query, key) pair: the score q·k and the value p·v, one multiply-add per channel
        each."""
        return 4 * cfg.d_model

    def _qkv(self, h: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = self.qkv(h).unflatten(-1, (3, self.n_heads, -1)).unbind(-3)  # (..., H, D) each
        rotary = self.rotary[0]
        return rotary(q, positions), rotary(k, positions), v

    def forward(self, h: Tensor, positions: Tensor | None = None) -> Tensor:
        """Every token, h (B, T, C) -> (B, T, C); or, with `positions` (B, T) increasing along
        each row, tokens gathered from those original positions, the same number from every
        sequence (top-k routing): causal attention by position is then causal attention over
        the gathered tokens' order, with no padding."""
        if positions is None:
            positions = torch.arange(h.shape[1], device=h.device)
        q, k, v = self._qkv(h, positions)  # (B, T, H, D)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, H, T, D)
        return self.proj(y.transpose(1, 2).flatten(-2))

    def forward_routed(self, h: Tensor, b: Tensor, t: Tensor, executed: Tensor) -> Tensor:
        """Executed tokens only: h (N, C) at batch rows b and positions t (N,), where `executed`
        (B, T) is the mask they came from. Skipped tokens write no key or value; executed tokens
        attend causally, by original position, to executed tokens of their own sequence."""
        B = executed.shape[0]
        q, k, v = self._qkv(h, t)  # (N, H, D)
        slot = (executed.cumsum(1) - 1)[b, t]  # place of each token among its sequence's executed
        # at least one slot, and the compiler told so: a width of 0 would be a special case of
        # attention that a data-dependent size cannot rule out (a graph break under torch.compile)
        K = int(executed.sum(1).max().clamp_min(1))
        torch._check(K >= 1)
        qkv = torch.stack((q, k, v))  # (3, N, H, D)
        # The buffer takes q/k/v's dtype, not h's: under autocast they are bf16 while h is fp32.
        padded = qkv.new_zeros(3, B, K, *q.shape[1:])  # (3, B, K, H, D)
        padded[:, b, slot] = qkv
        # Slots hold a sequence's executed tokens in position order and its padding after them,
        # so attending causally by original position among executed tokens is plain causal
        # attention over slots: no real query reaches a padding slot, and padding queries' outputs
        # are dropped. is_causal also lets the kernel skip the masked half instead of computing it.
        q, k, v = padded.transpose(2, 3).unbind(0)  # (B, H, K, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2)[b, slot].flatten(-2))  # (N, C)

    def forward_cached(self, h: Tensor, positions: Tensor, cache: KVCache) -> Tensor:
        """Every new token: h (B, T, C) at original positions (B, T), after the tokens in `cache`.
        Their keys and values are appended to it, and each attends to its row's cached entries
        and to the new tokens up to itself. -> (B, T, C)"""
        q, k, v = self._qkv(h, positions)  # (B, T, H, D)
        first = cache.append(k, v)
        return self.proj(self._attend_cached(q, first, cache))

    def forward_cached_routed(
        self, h: Tensor, b: Tensor, t: Tensor, executed: Tensor, positions: Tensor, cache: KVCache
    ) -> Tensor:
        """New executed tokens only: h (N, C) at batch rows b and columns t (N,) of the mask
        `executed` (B, T) of the new tokens, at original positions (N,). The rule of
        `forward_routed`, one chunk at a time: a row's executed tokens join its cached ones, in
        position order, and attend to them and to each other causally. -> (N, C)"""
        q, k, v = self._qkv(h, positions)  # (N, H, D)
        rank = (executed.cumsum(1) - 1)[b, t]  # place among the row's new executed tokens
        first = cache.write(b, rank, k, v, executed.sum(1))
        queries = q.new_zeros(executed.shape[0], int(rank.max()) + 1, *q.shape[1:])  # (B, K, H, D)
        queries[b, rank] = q
        return self.proj(self._attend_cached(queries, first, cache)[b, rank])

    def _attend_cached(self, q: Tensor, first: Tensor, cache: KVCache) -> Tensor:
        """Queries q (B, K, H, D) in slots first[b] + 0 .. K - 1 of their rows, each seeing its
        row's slots up to its own. -> (B, K, H * D) before the output projection."""
        B, K = q.shape[:2]
        keys, values = cache.entries()  # (B, H, S, D)
        S = keys.shape[2]
        if B == 1 and (K == 1 or S == K):
            # one sequence, so every slot is its own: the newest token sees them all, and a chunk
            # that fills an empty cache is plain causal attention
            mask, causal = None, K > 1
        else:
            # A padding query (its row has fewer new tokens) sees at least slot 0, so no row of
            # the mask is empty; its output is dropped. Slots past a row's own are never seen.
            own = first[:, None, None] + torch.arange(K, device=q.device)[:, None]  # (B, K, 1)
            mask, causal = (torch.arange(S, device=q.device) <= own).unsqueeze(1), False
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, is_causal=causal)
        return y.transpose(1, 2).flatten(-2)


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
        """Training and evaluation with skipped tokens: the sublayer computes the executed tokens
        alone; the write then runs over every token, with f = 0 and g = 0 where skipped, and its
        result is kept on the executed tokens only (`merge`). The write is per-token work, a few
        passes over (B, T, C); gathering the state lanes, writing the executed rows and scattering
        them back cost more passes than that, forward and backward (docs/benchmarks.md, "Speed
        under torch.compile"). Where every sequence executes the same number of tokens (top-k's
        `route.positions`, (B, K)) they are gathered with static shapes; otherwise by the mask."""
        executed = route.executed
        at = route.positions
        if at is not None:
            picked = _take(h, at)  # (B, K, C)
            f = self.compute(picked, at) if self.kind == "attn" else self.compute(picked)
            f = h.new_zeros(h.shape, dtype=f.dtype).scatter(1, _index(h, at), f)
            self.executed_per_seq = torch.full(h.shape[:1], at.shape[1], device=h.device)
        else:
            b, t = executed.nonzero(as_tuple=True)  # (N,) each, sorted by (b, t)
            picked = h[b, t]  # (N, C)
            if self.kind == "attn":
                f = self.compute.forward_routed(picked, b, t, executed)
            else:
                f = self.compute(picked)
            f = h.new_zeros(h.shape, dtype=f.dtype).index_put((b, t), f)
            self.executed_per_seq = executed.sum(1)
        gate = executed.to(h.dtype) if route.gate is None else route.gate * executed
        written, angle = strategy.write(state, f, gate, self.index, need_angle)
        if angle is not None:
            angle = torch.where(executed, angle, 0.0)  # a skipped token is not turned at all
        return merge(state, written, executed), angle

    def _run_cached(
        self, state: State, strategy: ResidualStrategy, h: Tensor, route: Route, cached: CachedPass
    ) -> State:
        """New tokens of generation: the executed ones run the sublayer, attention through the KV
        cache; their state rows are gathered, written and put back, and no write runs where no
        token executes (a step of generation is often one token)."""
        executed = cached.executes(route.executed)
        if executed is None:
            if self.kind == "attn":
                f = self.compute.forward_cached(h, cached.positions, cached.caches[self.index])
            else:
                f = self.compute(h)
            return strategy.write(state, f, route.gate, self.index, False)[0]
        b, t = executed.nonzero(as_tuple=True)  # (N,) each, sorted by (b, t)
        if b.numel() == 0:
            return state
        picked = tuple(lane[b, t] for lane in state)
        picked_h = h[b, t]  # (N, C)
        if self.kind == "attn":
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


def _index(lane: Tensor, at: Tensor) -> Tensor:
    """`at` (B, K) expanded over the trailing dimensions of a (B, T, ...) lane."""
    return at.view(*at.shape, *[1] * (lane.dim() - 2)).expand(*at.shape, *lane.shape[2:])


def _take(lane: Tensor, at: Tensor) -> Tensor:
    """(B, T, ...) -> (B, K, ...): each row's entries at positions `at` (B, K)."""
    return lane.gather(1, _index(lane, at))


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


@dataclass
class TransformerOutput:
    """logits (B, T, vocab) and the sum of the auxiliary losses: the routers' and the residual
    strategy's (`ResidualStrategy.aux_loss`)."""

    logits: Tensor
    aux_loss: Tensor


class Transformer(nn.Module):
    """Embedding -> residual strategy's stream through n_layers blocks -> LM head."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.strategy = build_residual(
            cfg.residual, cfg.d_model, cfg.n_sublayers, **cfg.residual_options
        )
        rotary = Rotary(cfg.d_model // cfg.n_heads, cfg.seq_len, cfg.rope_base)
        self.rotary = rotary
        blocks = []
        for layer in range(cfg.n_layers):
            sublayers = []
            for offset, (kind, compute) in enumerate(
                (("attn", Attention(cfg, rotary)), ("mlp", SwiGLU(cfg)))
            ):
                index = 2 * layer + offset
                router = (
                    build_router(cfg.router, cfg.d_model, **cfg.router_options)
                    if cfg.is_routed(index)
                    else build_router("none", cfg.d_model)
                )
                router.defer_updates = cfg.activation_checkpointing  # see stream()
                sublayers.append(Sublayer(kind, index, compute, router))
            blocks.append(Block(*sublayers))
        self.blocks = nn.ModuleList(blocks)
        self.check_routers()
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """normal(std), output projections scaled by 1/sqrt(2 n_layers) (GPT-2), std = init_std or
        1/sqrt(d_model)."""
        std = self.cfg.init_std if self.cfg.init_std is not None else self.cfg.d_model**-0.5
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, std=std / math.sqrt(self.cfg.n_sublayers))
            elif name.startswith("blocks.") and name.endswith("weight") and ".router." not in name:
                nn.init.normal_(param, std=std)
        nn.init.normal_(self.head.weight, std=std)
        nn.init.normal_(self.embed.weight, std=self.cfg.embed_std)

    def check_routers(self) -> None:
        """Refuse, before any forward pass, a router that reads the angle the residual strategy
        plans (`Router.reads_planned_angle`) where the strategy plans none."""
        if any(s.router.reads_planned_angle for s in self.sublayers) and not self.strategy.plans_angle:
            raise ValueError(
                "router_options.predictor 'angle' reads the angle the residual strategy plans before "
                f"a sublayer runs, and residual {self.cfg.residual!r} with these options plans none "
                "(only nag with angle: gate does): use predictor: probe, or the gated NAG."
            )

    @property
    def sublayers(self) -> list[Sublayer]:
        return [s for block in self.blocks for s in (block.attn, block.mlp)]

    def record_diagnostics(self, on: bool) -> None:
        """Keep each sublayer's contribution and state norm after the next forward passes."""
        for sublayer in self.sublayers:
            sublayer.record = on

    def forward(self, idx: Tensor) -> TransformerOutput:
        """idx (B, T) token ids -> logits (B, T, vocab)."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(
                f"The input has {T} tokens, more than model.arch.seq_len = {self.cfg.seq_len}; "
                "shorten it or raise model.arch.seq_len."
            )
        logits = self.readout(self.stream(idx))
        aux = sum((s.router.aux_loss for s in self.sublayers), idx.new_zeros((), dtype=torch.float))
        strategy_loss = self.strategy.aux_loss()
        if strategy_loss is not None:
            aux = aux + strategy_loss
        return TransformerOutput(logits=logits, aux_loss=aux)

    def stream(self, idx: Tensor, cached: CachedPass | None = None) -> State:
        """The residual state (B, T, ...) after the last block, for token ids idx (B, T); with
        `cached`, idx holds new tokens only and the earlier ones are in its KV caches."""
        self.apply_router_updates()
        state = self.strategy.init_state(self.embed(idx))
        for block in self.blocks:
            if cached is not None:
                state = block(state, self.strategy, cached)
            elif self.cfg.activation_checkpointing and torch.is_grad_enabled():
                # Backward runs the block again, routers included: their state updates wait
                # (`Router.defer_updates`) until `apply_router_updates` after backward, so the
                # second pass routes exactly as the first.
                state = checkpoint(block, state, self.strategy, use_reentrant=False)
            else:
                state = block(state, self.strategy)
        return state

    def apply_router_updates(self) -> None:
        """Apply the routers' state updates that the last training forward left pending (with
        activation checkpointing; without it, routers apply them at once). Training calls it after
        each backward; the next forward pass calls it too, so a plain training loop needs nothing."""
        for sublayer in self.sublayers:
            sublayer.router.apply_update()

    def readout(self, state: State) -> Tensor:
        """Logits (..., vocab) of the residual state of any tokens (..., ...)."""
        features, scale = self.strategy.final(state)
        if scale is not None:
            # The head has no bias, so scaling its input scales the logits: one pass over
            # (..., d_model) instead of over (..., vocab), forward and backward.
            features = features * scale
        return self.head(features.to(self.head.weight.dtype))
