"""The NAG write's backward in plain PyTorch: the backward kernel's formulas, a row per token.

The operator's PyTorch implementation (`ops.py`) cannot run autograd inside itself (operators run
below the autograd dispatch), and autograd through `nag_write_reference` would be slower anyway:
it runs the whole forward again, outputs included, builds a graph of about forty nodes and
differentiates each. This recomputes only the intermediates the gradients need, as the kernel's
`_recompute_row` does, and applies the chain rule written out in `_nag_write_bwd_kernel`
(`nag_write.py`), vectorised over rows. It is tested against autograd through the reference,
including the small-tangent branch and both bounds, and by gradcheck in float64.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .reference import _compute_dtype, bound_angle, row_scale, tangent_cutoff, too_small_to_turn


def nag_write_reference_backward(
    u: Tensor, f: Tensor, g: Tensor | None, alpha: Tensor, beta: Tensor, theta_max: float,
    gamma_next: Tensor | None, bound: str,
    grad_u: Tensor | None, grad_rho: Tensor | None, grad_theta: Tensor | None, grad_h: Tensor | None,
    rows: Tensor | None = None, angle: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor | None, Tensor | None]:  # fmt: skip
    """Gradients (du, df, dg, dalpha, dbeta, dgamma, dangle) of a NAG write, each in its input's
    dtype; dg, dgamma and dangle are None without g, gamma_next and angle. Arguments as in
    `nag_write_reference`, g of rho's shape, and the incoming gradients of (u', rho', theta,
    h_next), None where an output does not reach the loss; `rows`, the forward's per-row numbers
    (`nag_write_reference`'s return_rows), or None to recompute them. (rho's gradient is grad_rho
    itself and is not returned.) With a given angle, alpha's gradient is zero."""
    d = u.shape[-1]
    ct = _compute_dtype(u.dtype)
    inv_sqrt_d, sqrt_d = 1.0 / math.sqrt(d), math.sqrt(d)
    u32, f32 = u.to(ct), f.to(ct)  # (..., d)
    gate = torch.ones((), dtype=ct, device=u.device) if g is None else g.to(ct)  # (...,) or ()
    alpha32, beta32 = alpha.to(ct), beta.to(ct)
    k = gate * alpha32 * inv_sqrt_d

    # The forward's per-row numbers (the kernel's _recompute_row), without raw: every (..., d)
    # vector of the write is a combination of u, p = f_perp_hat and the incoming gradient G, so
    # the backward needs only their dot products and two final combinations.
    if rows is None:
        m = row_scale(f32)  # (...,)
        f_hat = f32 * (1 / m)[..., None]  # exact, as in the reference
        a_hat = _dot(f_hat, u32)
        p = torch.addcmul(f_hat, a_hat[..., None], u32, value=-1)  # f_perp_hat, (..., d)
        n_hat = torch.linalg.vector_norm(p, dim=-1)
        norm_u = torch.linalg.vector_norm(u32, dim=-1)
    else:  # the forward's own numbers: only f_perp_hat itself is formed again
        m, a_hat, n_hat, norm_u = rows.to(ct).unbind(-1)
        p = torch.addcmul(f32 * (1 / m)[..., None], a_hat[..., None], u32, value=-1)
    n = m * n_hat
    given = angle is not None
    big = ~too_small_to_turn(a_hat, n_hat, tangent_cutoff(f.dtype))
    theta = torch.where(big, angle.to(ct), 0.0) if given else bound_angle(k * n, theta_max, bound)
    c, s = torch.cos(theta), torch.sin(theta)
    n_hat_safe = torch.where(big, n_hat, 1.0)
    s_hat = torch.where(big, s / n_hat_safe, 0.0 if given else k * m)
    uu, pu, pp = norm_u.square(), _dot(p, u32), n_hat.square()
    # raw = c u + s_hat p; its norm from the dot products (the forward took it from raw itself:
    # they differ by rounding, which only the gradients see)
    norm_raw = (c * c * uu + 2 * c * s_hat * pu + s_hat * s_hat * pp).clamp_min(0).sqrt()
    norm_raw_safe = torch.where(norm_raw > 0, norm_raw, 1.0)
    r = norm_u / norm_raw_safe

    # u' = r raw and h = sqrt(d) u' gamma: G, the total gradient reaching u'.
    G = torch.zeros_like(u32) if grad_u is None else grad_u.to(ct)
    dgamma = None
    if gamma_next is not None:
        dgamma = torch.zeros(d, dtype=ct, device=u.device)
        if grad_h is not None:
            gh = grad_h.to(ct)
            # every full-size pass counts on CPU: the (d,) factors are folded before they meet rows
            G = torch.addcmul(G, gh, sqrt_d * gamma_next.to(ct))
            u_new = torch.addcmul((r * c)[..., None] * u32, (r * s_hat)[..., None], p)
            dgamma = (gh * u_new).reshape(-1, d).sum(0) * sqrt_d
    Gu, Gp = _dot(G, u32), _dot(G, p)

    # r = ||u|| / ||raw||: d r / d raw = -r raw / ||raw||^2, d r / d u = u / (||u|| ||raw||), so
    # g_raw = r G - k1 raw with k1 = q r / ||raw||^2, q = <G, raw>.
    q = c * Gu + s_hat * Gp
    k1 = q * r / norm_raw_safe.square()
    norm_u_safe = torch.where(norm_u > 0, norm_u, 1.0)
    g_cos = r * Gu - k1 * (c * uu + s_hat * pu)  # <g_raw, u>
    g_s = r * Gp - k1 * (c * pu + s_hat * pp)  # <g_raw, p>

    # s_hat = sin(theta) / n_hat where big, else k m; theta = bound(k m n_hat).
    g_theta = -s * g_cos + torch.where(big, c / n_hat_safe * g_s, 0.0)
    if grad_theta is not None:
        g_theta = g_theta + grad_theta.to(ct)
    g_n = torch.where(big, -s / n_hat_safe.square() * g_s, 0.0)  # d / d n_hat
    if given:  # theta is an input: nothing of it depends on k (alpha, g) or on n
        g_k = torch.zeros_like(n)
    else:
        g_k = torch.where(big, 0.0, g_s * m)
        if bound == "rational":  # theta_max^2 / (theta_max + |x|)^2
            g_x = g_theta * (theta_max / (theta_max + (k * n).abs())).square()
        else:
            g_x = g_theta * (1 - (theta / theta_max).square())
        g_k = g_k + g_x * n
        g_n = g_n + g_x * (k * m)
    n_pos = torch.where(n_hat > 0, n_hat, 1.0)

    # g_p = s_hat g_raw + (g_n / n_hat) p (n_hat = ||p||, gradient 0 at 0 as torch's norm), in
    # the basis (G, u, p); p = f_hat - a_hat u, so g_a = -<g_p, u> is the gradient of a_hat.
    gp_G, gp_u, gp_p = s_hat * r, -s_hat * k1 * c, g_n / n_pos - s_hat * s_hat * k1
    g_a = -(gp_G * Gu + gp_u * uu + gp_p * pu)

    # rho' = rho + g beta m a_hat / sqrt(d)
    g_g = g_k * alpha32 * inv_sqrt_d
    dbeta = torch.zeros((), dtype=ct, device=u.device)
    if grad_rho is not None:
        grho = grad_rho.to(ct)
        a = m * a_hat
        g_a = g_a + grho * gate * beta32 * m * inv_sqrt_d
        g_g = g_g + grho * beta32 * a * inv_sqrt_d
        dbeta = (grho * gate * a).sum() * inv_sqrt_d
    dalpha = (g_k * gate).sum() * inv_sqrt_d

    # du = ||u||-term + c g_raw - a_hat g_p + g_a f_hat, with f_hat = p + a_hat u; df = (g_p + g_a u) / m.
    du_G = c * r - a_hat * gp_G
    du_u = q / (norm_raw_safe * norm_u_safe) - c * c * k1 - a_hat * gp_u + g_a * a_hat
    du_p = -c * k1 * s_hat - a_hat * gp_p + g_a
    du = _combine(G, du_G, u32, du_u, p, du_p)
    df = _combine(G, gp_G / m, u32, (gp_u + g_a) / m, p, gp_p / m)
    return (
        du.to(u.dtype), df.to(f.dtype), None if g is None else g_g.to(g.dtype),
        dalpha.to(alpha.dtype).reshape(alpha.shape), dbeta.to(beta.dtype).reshape(beta.shape),
        None if dgamma is None else dgamma.to(gamma_next.dtype),
        torch.where(big, g_theta, 0.0).to(angle.dtype) if given else None,  # theta = 0 where not big
    )  # fmt: skip


def _dot(x: Tensor, y: Tensor) -> Tensor:
    """<x, y> per row: (..., d) x (..., d) -> (...,)."""
    return torch.linalg.vecdot(x, y)


def _combine(x: Tensor, a: Tensor, y: Tensor, b: Tensor, z: Tensor, c: Tensor) -> Tensor:
    """a x + b y + c z with per-row coefficients (...,): one new tensor, written three times."""
    out = a[..., None] * x
    out.addcmul_(b[..., None], y)
    return out.addcmul_(c[..., None], z)
