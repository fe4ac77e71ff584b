"""Causal self-attention with rotary positions, over all tokens or only the executed ones of a routed
sublayer, with or without a KV cache (generation).
Shapes: B batch, T sequence, C = d_model, N executed tokens, K executed tokens of the longest
sequence (the padded width routed attention runs at), H heads, D head width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nag_lightning.model.config import TransformerConfig
from nag_lightning.model.kv_cache import KVCache


class Rotary(nn.Module):
    """Rotary position embedding (RoPE) for any positions, including gathered ones."""

    def __init__(self, head_dim: int, seq_len: int, base: float) -> None:
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq_len).float(), inv_freq)  # (seq_len, D/2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        # Per channel, for the pairs (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos) as one
        # expression, x * cos + partner(x) * sin with the sign on sin: two multiplies and an add,
        # where splitting the pairs and stacking the halves adds a copy forward and one backward
        # (measured in docs/benchmarks.md, "MoD that saves time"); bitwise the same values.
        self.register_buffer("cos_pairs", angles.cos().repeat_interleave(2, -1), persistent=False)
        self.register_buffer("sin_pairs", torch.stack((-angles.sin(), angles.sin()), -1).flatten(-2),
                             persistent=False)  # (seq_len, D)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (..., P, H, D) at integer positions (..., P)."""
        cos = self.cos_pairs[positions].unsqueeze(-2).to(x.dtype)  # (..., P, 1, D)
        sin = self.sin_pairs[positions].unsqueeze(-2).to(x.dtype)
        partner = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x2, x1) in the place of each (x1, x2)
        return x * cos + partner * sin


class Attention(nn.Module):
    """Causal multi-head attention through `scaled_dot_product_attention`, no biases."""

    def __init__(self, cfg: TransformerConfig, rotary: Rotary) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.rotary = [rotary]  # shared with the other blocks; a list keeps it out of this module
        self.attend_skipped = cfg.attend_skipped

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

    def forward_every_key(self, h: Tensor, at: Tensor) -> Tensor:
        """Queries at positions `at` (B, K) only, keys and values from every token of h (B, T, C)
        (`attend_skipped`): each query attends causally, by position, to every token of its
        sequence up to itself, executed or not. -> (B, K, C)"""
        picked = h.gather(1, at[..., None].expand(-1, -1, h.shape[-1]))  # (B, K, C)
        return self.proj(self._every_key(h, self._queries(picked, at), at))

    def forward_every_key_masked(self, h: Tensor, b: Tensor, t: Tensor, executed: Tensor) -> Tensor:
        """`forward_every_key` for the tokens `executed` (B, T) marks, at rows b and positions t
        (N,), however many each sequence has: their queries are packed into slots; padding
        slots query nothing (zeros, at the last position) and their outputs are dropped. -> (N, C)"""
        slot = (executed.cumsum(1) - 1)[b, t]
        K = int(executed.sum(1).max().clamp_min(1))
        torch._check(K >= 1)
        q = self._queries(h[b, t], t)  # (N, H, D)
        queries = q.new_zeros(executed.shape[0], K, *q.shape[1:])  # (B, K, H, D)
        queries[b, slot] = q
        at = t.new_full((executed.shape[0], K), executed.shape[1] - 1)
        at[b, slot] = t
        return self.proj(self._every_key(h, queries, at)[b, slot])

    def _queries(self, h: Tensor, positions: Tensor) -> Tensor:
        """Queries alone, h (..., C) at `positions` (...) -> (..., H, D)."""
        w_q = self.qkv.weight[: h.shape[-1]]
        return self.rotary[0](F.linear(h, w_q).unflatten(-1, (self.n_heads, -1)), positions)

    def _every_key(self, h: Tensor, q: Tensor, at: Tensor) -> Tensor:
        """Queries q (B, K, H, D) at positions `at` (B, K) against the keys and values of every
        token of h (B, T, C), causally by position. -> (B, K, H * D) before the output projection."""
        C, T = h.shape[-1], h.shape[1]
        positions = torch.arange(T, device=h.device)
        k, v = F.linear(h, self.qkv.weight[C:]).unflatten(-1, (2, self.n_heads, -1)).unbind(-3)
        k = self.rotary[0](k, positions)  # (B, T, H, D)
        mask = (positions <= at[..., None]).unsqueeze(1)  # (B, 1, K, T)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask)
        return y.transpose(1, 2).flatten(-2)

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
