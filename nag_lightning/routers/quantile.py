"""Where a threshold router splits a batch's predictions to skip a given share of its tokens."""

from __future__ import annotations

import torch
from torch import Tensor

SPLIT_BAND = 0.02
"""How far (a share of the batch's tokens) a batch's evaluation threshold may split from the target
share to sit in a gap between predictions rather than inside a cluster of them."""


def split_threshold(values: Tensor, rate: Tensor, band_share: float = SPLIT_BAND) -> Tensor:
    """A threshold that skips the share `rate` of a batch's predictions `values`, to within
    `band_share` of the tokens: halfway (geometric mean) across the widest gap between consecutive
    predictions in that band. Predictions cluster (tokens at theta_max, tokens in identical
    states such as a byte that skipped every earlier sublayer, which share one value exactly),
    and a threshold inside a cluster moves many tokens across it when the predictions drift a
    little from one batch to the next; a threshold in a gap moves few. Where one value fills
    the band, the nearest split between distinct values is taken. Never skips every token."""
    v = values.sort().values.clamp_min(1e-12)  # (n,)
    n = v.numel()
    target = rate * n
    band = rate.clamp(max=band_share) * n
    splits = torch.arange(n, device=v.device)  # the split skips the `split` smallest
    gap = torch.zeros(n, device=v.device)
    gap[1:] = v[1:].log() - v[:-1].log()
    in_band = (splits - target).abs() <= band
    # indices stay (1,) tensors read by gather, not v[index]: indexing by a 0-dim tensor
    # reads it on the host, a graph break under torch.compile
    widest = gap.masked_fill(~in_band, -1.0).argmax().view(1)
    possible = (gap > 0) | (splits == 0)
    nearest = (splits - target).abs().masked_fill(~possible, float("inf")).argmin().view(1)
    split = torch.where(gap.gather(0, widest) > 0, widest, nearest)
    lower, upper = v.gather(0, (split - 1).clamp_min(0)), v.gather(0, split)
    return torch.where(split > 0, (lower * upper).sqrt(), v[:1]).squeeze(0)
