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
by `inference`, beside this module). The architecture's settings are `config`'s, attention is
`attention`'s, the MLP, the `Sublayer` wrapper and the `Block` are `sublayer`'s; this module puts
them together, and its names are importable from here and from `nag_lightning.model`.
Shapes: B batch, T sequence, C = d_model, N executed tokens, K executed tokens of the longest
sequence (the padded width routed attention runs at), H heads, D head width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from nag_lightning.model.attention import Attention, Rotary
from nag_lightning.model.config import RESUMABLE_CHANGES, SUBLAYER_KINDS, TransformerConfig
from nag_lightning.model.kv_cache import CachedPass
from nag_lightning.model.sublayer import SUBLAYER_MODULES, Block, Sublayer, SwiGLU, merge
from nag_lightning.residuals import State, build_residual
from nag_lightning.routers import build_router

__all__ = [
    "RESUMABLE_CHANGES", "SUBLAYER_KINDS", "SUBLAYER_MODULES", "Attention", "Block", "Rotary", "Sublayer",
    "SwiGLU", "Transformer", "TransformerConfig", "TransformerOutput", "merge",
]


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
                    build_router(cfg.router, cfg.d_model, **cfg.router_options_of(index))
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

    def set_progress(self, progress: float) -> None:
        """How far training has come, 0 to 1, for every router (`Router.set_progress`: the skip-rate
        warm-up); the LightningModule calls it before each training step."""
        for sublayer in self.sublayers:
            sublayer.router.set_progress(progress)

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
