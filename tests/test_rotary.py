"""Rotary positions as one expression (x cos + partner(x) sin) give bitwise the values of rotating
each channel pair (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos), at any positions and dtype."""

from __future__ import annotations

import pytest
import torch

from nag_lightning.model.attention import Rotary


def rotate_pairs(rotary: Rotary, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The pairwise rotation, written out: the definition the rotary module must keep."""
    cos = rotary.cos[positions].unsqueeze(-2).to(x.dtype)
    sin = rotary.sin[positions].unsqueeze(-2).to(x.dtype)
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_the_pairwise_rotation_bitwise(dtype):
    rotary = Rotary(head_dim=6, seq_len=37, base=10000.0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, 5, 6, generator=gen).to(dtype)  # (B, T, H, D)
    for positions in (torch.arange(37), torch.randint(0, 37, (3, 37), generator=gen)):
        assert torch.equal(rotary(x, positions), rotate_pairs(rotary, x, positions))
    flat = x[0, :11]  # gathered tokens (N, H, D) at their own positions, as routed attention has them
    at = torch.randint(0, 37, (11,), generator=gen)
    assert torch.equal(rotary(flat, at), rotate_pairs(rotary, flat, at))


def test_rotary_gradient_is_the_pairwise_rotations():
    rotary = Rotary(head_dim=4, seq_len=9, base=100.0)
    x = torch.randn(2, 9, 3, 4, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(2, 9, 3, 4, dtype=torch.float64)
    positions = torch.arange(9)
    (ours,) = torch.autograd.grad(rotary(x, positions), x, grad)
    (pairs,) = torch.autograd.grad(rotate_pairs(rotary, x, positions), x, grad)
    torch.testing.assert_close(ours, pairs, rtol=0, atol=1e-12)
