"""Key/value cache of routed attention, for generation that computes each token once.

A token that skips an attention sublayer writes no key or value there (DESIGN section 4), so each
attention sublayer keeps its own cache, holding only the tokens that executed it: a model that
skips a quarter of its attention executions holds a quarter fewer entries, and a skipped token
costs that sublayer nothing. Under `attend_skipped` every real token enters every cache. Plain
torch; `nag_lightning.model.inference` drives it.

    KVCache      one attention sublayer: per sequence, the keys and values of its executed tokens,
                 packed in position order into slots 0, 1, ... (keys after rotary embedding)
    CachedPass   one forward pass over new tokens: their positions, which are real (not padding),
                 the caches, and what each sublayer ran, for the report
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


class KVCache:
    """Keys and values of one attention sublayer, for the tokens that executed it.

    Row b holds `length[b]` entries, in slots 0 .. length[b] - 1, in position order. Slots beyond
    a row's length may hold stale values (of a row reset for a new window); attention never lets a
    real query see them, because a query sees only slots up to its own. Storage grows with the
    longest row, about a quarter at a time.

    Args:
        batch: number of sequences.
        n_heads: attention heads H.
        head_dim: head width D.
        dtype: dtype of the keys and values (the attention weights').
        device: where they live.
        limit: most entries a row can need (the model's seq_len); storage never grows past it.
    """

    def __init__(
        self, batch: int, n_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
        limit: int,
    ) -> None:
        self.k = torch.zeros(batch, n_heads, 0, head_dim, dtype=dtype, device=device)  # (B, H, S, D)
        self.v = torch.zeros_like(self.k)
        self.length = torch.zeros(batch, dtype=torch.long, device=device)
        self.limit = limit
        self._used = 0  # host copy of length.max(): the slots attention reads

    def append(self, k: Tensor, v: Tensor) -> Tensor:
        """Store k, v (B, T, H, D) of T new tokens of every row after the row's entries; returns
        each row's first new slot (B,)."""
        first = self.length
        T = k.shape[1]
        self._extend(first + T)
        if k.shape[0] == 1:  # one row: a slice, no scattered writes
            start = self._used - T
            self.k[:, :, start : self._used] = k.transpose(1, 2)
            self.v[:, :, start : self._used] = v.transpose(1, 2)
        else:
            rows = torch.arange(k.shape[0], device=k.device)[:, None].expand(-1, T)
            slots = first[:, None] + torch.arange(T, device=k.device)
            self.k[rows, :, slots] = k
            self.v[rows, :, slots] = v
        return first

    def write(self, b: Tensor, rank: Tensor, k: Tensor, v: Tensor, added: Tensor) -> Tensor:
        """Store k, v (N, H, D) of rows b, the rank-th new entry of each (N,), after the row's
        entries; `added` (B,) new entries per row. Returns each row's first new slot (B,)."""
        first = self.length
        self._extend(first + added)
        slot = first[b] + rank
        self.k[b, :, slot] = k
        self.v[b, :, slot] = v
        return first

    def _extend(self, length: Tensor) -> None:
        """Set the rows' entry counts, growing the storage when a row needs more slots."""
        self.length = length
        self._used = int(length.max())
        if self._used > self.k.shape[2]:
            capacity = min(max(self.limit, self._used), -(-self._used * 5 // 4 // 16) * 16)
            grown = self.k.new_zeros(2, *self.k.shape[:2], capacity, self.k.shape[3])
            grown[0, :, :, : self.k.shape[2]] = self.k
            grown[1, :, :, : self.v.shape[2]] = self.v
            self.k, self.v = grown.unbind(0)

    def entries(self) -> tuple[Tensor, Tensor]:
        """Keys and values (B, H, S, D) of the slots in use by any row."""
        return self.k[:, :, : self._used], self.v[:, :, : self._used]

    def reset(self, rows: Tensor) -> None:
        """Empty the given rows (a bool (B,) mask or indices), e.g. to start a new window."""
        self.length = self.length.masked_fill(rows, 0) if rows.dtype == torch.bool else (
            self.length.index_fill(0, rows, 0))
        self._used = int(self.length.max())

    @property
    def entry_bytes(self) -> int:
        """Bytes of one token's key and value."""
        return 2 * self.k.shape[1] * self.k.shape[3] * self.k.element_size()

    def nbytes(self) -> int:
        """Bytes the live entries take (what the cache must hold)."""
        return int(self.length.sum()) * self.entry_bytes

    def allocated_bytes(self) -> int:
        """Bytes of storage held, live entries, growth headroom and row padding together."""
        return self.k.nbytes + self.v.nbytes


@dataclass
class CachedPass:
    """What one forward pass over new tokens needs besides their residual state.

    Attributes:
        caches: the KV cache of every attention sublayer, by sublayer index.
        positions: (B, T) original position of each new token (RoPE reads it).
        valid: (B, T) False on padding, which executes nothing and writes no key or value; None
            when every new token is real.
        executed: filled in by the pass: for each sublayer in order, the (B, T) tokens that ran it
            (None: all of them).
    """

    caches: dict[int, KVCache]
    positions: Tensor
    valid: Tensor | None = None
    executed: list[Tensor | None] = field(default_factory=list)

    def executes(self, executed: Tensor | None) -> Tensor | None:
        """The tokens that run the sublayer given the router's decision `executed` (None: all):
        real tokens only; None when that is every token. Recorded for `executed_counts`."""
        if self.valid is not None:
            executed = self.valid if executed is None else executed & self.valid
        elif executed is not None and bool(executed.all()):
            executed = None  # every token runs: no gather and scatter
        self.executed.append(executed)
        return executed

    def executed_counts(self) -> Tensor:
        """(B, T) number of sublayers each new token ran (0 on padding)."""
        counts = torch.zeros_like(self.positions)
        for executed in self.executed:
            counts += 1 if executed is None else executed.long()
        return counts
