"""Pure-PyTorch reference of the NAG write (DESIGN.md section 2).

This is the ground truth the Triton kernel is tested against, and the path used on CPU. It is
written for clarity, not speed: every intermediate is a separate tensor, and autograd derives the
backward.

Per row (token), with `u` the unit direction lane, `f` the sublayer output and `rho` the log-norm
lane::

    a       = <f, u>                      radial part of the update
    f_perp  = f - a u                     tangential part, n = ||f_perp||
                                          (both computed on f / 2^k, see `row_scale`)
    x       = g * alpha * n / sqrt(d)     unbounded rotation angle
    theta   = theta_max * tanh(x / theta_max)          bound "tanh", or
              theta_max * x / (theta_max + |x|)        bound "rational"
    s       = sin(theta) / n              (limit g * alpha / sqrt(d) when f is too small to turn)
    raw     = cos(theta) u + s f_perp
    u'      = raw * ||u|| / ||raw||       renormalised: ||u'|| = ||u|| to rounding, for any f
    rho'    = rho + g * beta * a / sqrt(d)
    h_next  = sqrt(d) * u' * gamma_next   the next sublayer's read (optional)

With a given `angle` (the gated NAG, which takes its angle from a learned gate on u rather than
from n), theta = angle per row; alpha and the bound are unused, and g scales only the radial
update. Where f is too small to turn, theta = 0 (s = 0: there is no direction to turn toward), so
the theta returned is always the turn applied.

f is too small to turn where n <= tangent_cutoff(f.dtype) * max(|f / m|, 1): its tangential part
is then within the rounding of f and of the computation, so its direction is noise (f parallel to
u at any scale gives n of a few ulps of |f|, not 0). The cutoff is relative: a tiny f that is not
parallel to u turns like any other (row_scale makes n / m well scaled), and only a zero or
subnormal f is too small whatever its direction.

The final renormalisation costs one extra reduction and buys two things: `||u'||` stays at 1 to
rounding even when `f` is huge or nearly parallel to `u` (where `cos^2 + s^2 n^2 = 1` holds only
approximately), and `g = 0` is an exact identity bitwise, since then `raw == u` and `x / x == 1`.
"""

from __future__ import annotations

import math

import torch


def tangent_cutoff(dtype: torch.dtype) -> float:
    """The largest n / |f| that is rounding noise for an f of `dtype`, computed in
    `_compute_dtype(dtype)`: f parallel to u measured n / |f| <= 8 ulps (fp32, bf16, fp16, fp64,
    d = 5 to 4096, |f| from 1e-30 to 1e30), so 4 ulps of f and 16 of the computation."""
    return 4 * torch.finfo(dtype).eps + 16 * torch.finfo(_compute_dtype(dtype)).eps


def too_small_to_turn(a_hat: torch.Tensor, n_hat: torch.Tensor, cutoff: float) -> torch.Tensor:
    """Rows whose tangential part is rounding noise: n_hat <= cutoff * |f_hat|, with |f_hat| from
    its radial and tangential parts. |f_hat| >= 1 but for a zero or subnormal f (row_scale), which
    the floor of 1 takes as too small: dividing by its n_hat could overflow."""
    return n_hat <= cutoff * torch.hypot(a_hat, n_hat).clamp_min(1.0)

BOUNDS = ("tanh", "rational")
"""How the angle is bounded to (-theta_max, theta_max). Both have slope 1 at 0. tanh saturates
exponentially: past |x| ~ 3 theta_max its gradient is ~0 and a sublayer can no longer learn
per-token angles. rational, x / (1 + |x| / theta_max), approaches the bound like 1/x, so its
gradient, (1 - |theta| / theta_max)^2, decays only polynomially."""


def bound_angle(x: torch.Tensor, theta_max: float, bound: str) -> torch.Tensor:
    """The bounded angle of an unbounded one, `x`, by `bound` (one of BOUNDS)."""
    if bound == "tanh":
        return theta_max * torch.tanh(x / theta_max)
    if bound == "rational":
        # Two forms of the same function: x / (theta_max + |x|) is accurate for small |x|; past
        # theta_max, 1 - theta_max / (theta_max + |x|) keeps |theta| <= theta_max and gives
        # autograd a derivative without the cancellation of the quotient rule (1/D - |x|/D^2).
        denom = theta_max + x.abs()
        near = x / denom
        far = torch.sign(x) * (1 - theta_max / denom)
        return theta_max * torch.where(x.abs() < theta_max, near, far)
    raise ValueError(f"bound must be one of {BOUNDS}; got {bound!r}.")


def row_scale(f: torch.Tensor) -> torch.Tensor:
    """Per row of f (..., d), the largest power of two <= max|f| (1 when max|f| is 0 or subnormal).

    Dividing by it is exact and brings the row's largest element into [1, 2), so squares and sums
    of squares of the scaled row cannot overflow or underflow, for any finite f. It is max|f| with
    its mantissa bits cleared, as the kernels take it from the exponent bits: bit operations that
    a compiler vectorizes, where frexp and ldexp run one element at a time. It is a constant of
    the computation (every output is invariant to it), so it carries no gradient."""
    f = f.detach()
    peak = torch.maximum(f.amax(-1), -f.amin(-1))  # max|f| without a tensor of |f|
    bits, exponent = _EXPONENT_BITS[peak.dtype]
    power = (peak.view(bits) & exponent).view(peak.dtype)  # 2 ** floor(log2(peak)) for a normal peak
    return torch.where(peak >= torch.finfo(peak.dtype).tiny, power, torch.ones_like(peak))


_EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}
"""The integer type of each compute dtype's bits and the mask of its exponent field."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # fp32 for fp32/bf16/fp16 inputs; fp64 stays fp64 so gradcheck can run on the reference.
    return torch.promote_types(dtype, torch.float32)


def nag_write_reference(
    u: torch.Tensor,
    f: torch.Tensor,
    rho: torch.Tensor,
    g: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    theta_max: float,
    gamma_next: torch.Tensor | None = None,
    bound: str = "tanh",
    return_rows: bool = False,
    angle: torch.Tensor | None = None,
):
    """One NAG write, in plain PyTorch.

    Args:
        u: direction lane, shape (..., d), unit norm per row.
        f: sublayer output, shape (..., d).
        rho: log-norm lane, shape (...,).
        g: per-token gate in [0, 1], shape (...,); None means 1 (no router).
        alpha: 0-dim tensor, the sublayer's rotation gain (may be negative).
        beta: 0-dim tensor, the sublayer's log-norm gain.
        theta_max: bound on |theta|, a positive float (pi / 2 in DESIGN.md).
        gamma_next: per-channel gain of the next read, shape (d,); None skips h_next.
        bound: how theta is bounded, one of BOUNDS.
        return_rows: also return the per-row numbers the backward would otherwise recompute.
        angle: the angle to turn each row by, shape (...,), instead of bound(g alpha n / sqrt(d)).

    Returns:
        (u_new, rho_new, theta, h_next): u_new and h_next in u.dtype, rho_new and theta
        (signed, shape (...,)) in rho.dtype; h_next is None when gamma_next is None.
        Everything is computed in fp32 (fp64 for fp64 inputs). With return_rows,
        ((u_new, rho_new, theta, h_next), rows): rows of shape (..., 4) in the compute dtype hold
        (m, a_hat, n_hat, ||u||), the row scale, the radial part and the tangential norm of
        f / m, and the norm of u; 16 bytes a token that save the backward five passes over (..., d).
    """
    d = u.shape[-1]
    ct = _compute_dtype(u.dtype)
    inv_sqrt_d = 1.0 / math.sqrt(d)

    u32, f32 = u.to(ct), f.to(ct)  # (..., d)
    gate = 1.0 if g is None else g.to(ct)  # (...,) or scalar
    k = gate * alpha.to(ct) * inv_sqrt_d  # (...,): dtheta/dn at n = 0

    # Work on f / m (m = row_scale(f), a power of two), so ||f_perp||^2 cannot overflow however
    # large f is: n = m * ||f_perp / m|| and f_perp / n = (f_perp / m) / (n / m).
    m = row_scale(f32)  # (...,)
    f_hat = f32 * (1 / m)[..., None]  # (..., d), exact: m and 1 / m are powers of two
    a_hat = torch.linalg.vecdot(f_hat, u32)  # (...,)
    f_perp_hat = torch.addcmul(f_hat, a_hat[..., None], u32, value=-1)  # f_hat - a_hat u, (..., d)
    n_hat = torch.linalg.vector_norm(f_perp_hat, dim=-1)  # (...,)
    a, n = m * a_hat, m * n_hat
    small = too_small_to_turn(a_hat, n_hat, tangent_cutoff(f.dtype))
    # a given angle turns only where f has a direction to turn toward (where() also makes a copy:
    # the theta output must not alias an input, which custom operators forbid)
    theta = bound_angle(k * n, theta_max, bound) if angle is None else torch.where(small, 0.0, angle.to(ct))

    # Divide by n only where it is safe; the where() on n itself keeps NaN out of the gradients.
    # s_hat = sin(theta) / n_hat multiplies f_perp / m: the same term as sin(theta) / n times f_perp.
    n_hat_safe = torch.where(small, torch.ones_like(n_hat), n_hat)
    limit = k * m if angle is None else torch.zeros_like(n)
    s_hat = torch.where(small, limit, torch.sin(theta) / n_hat_safe)

    raw = torch.addcmul(torch.cos(theta)[..., None] * u32, s_hat[..., None], f_perp_hat)  # (..., d)
    norm_u = torch.linalg.vector_norm(u32, dim=-1)
    norm_raw = torch.linalg.vector_norm(raw, dim=-1)
    norm_raw_safe = torch.where(norm_raw > 0, norm_raw, torch.ones_like(norm_raw))
    u_new = raw * (norm_u / norm_raw_safe)[..., None]

    rho_new = rho.to(ct) + gate * beta.to(ct) * a * inv_sqrt_d
    h_next = None
    if gamma_next is not None:
        h_next = (u_new * (math.sqrt(d) * gamma_next.to(ct))).to(u.dtype)  # one pass over u_new
    outs = (u_new.to(u.dtype), rho_new.to(rho.dtype), theta.to(rho.dtype), h_next)
    return (outs, torch.stack((m, a_hat, n_hat, norm_u), dim=-1)) if return_rows else outs

