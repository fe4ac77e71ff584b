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

from .reference import EPS, _compute_dtype, bound_angle, row_scale


def nag_write_reference_backward(
    u: Tensor, f: Tensor, g: Tensor | None, alpha: Tensor, beta: Tensor, theta_max: float,
    gamma_next: Tensor | None, bound: str,
    grad_u: Tensor | None, grad_rho: Tensor | None, grad_theta: Tensor | None, grad_h: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor | None]:  # fmt: skip
    """Gradients (du, df, dg, dalpha, dbeta, dgamma) of a NAG write, each in its input's dtype;
    dg and dgamma are None without g and gamma_next. Arguments as in `nag_write_reference`, g of
    rho's shape, and the incoming gradients of (u', rho', theta, h_next), None where an output
    does not reach the loss. (rho's gradient is grad_rho itself and is not returned.)"""
    d = u.shape[-1]
    ct = _compute_dtype(u.dtype)
    inv_sqrt_d, sqrt_d = 1.0 / math.sqrt(d), math.sqrt(d)
    u32, f32 = u.to(ct), f.to(ct)  # (..., d)
    gate = torch.ones((), dtype=ct, device=u.device) if g is None else g.to(ct)  # (...,) or ()
    alpha32, beta32 = alpha.to(ct), beta.to(ct)
    k = gate * alpha32 * inv_sqrt_d

    # The forward up to the renormalisation (the kernel's _recompute_row).
    m = row_scale(f32)  # (...,)
    f_hat = f32 / m[..., None]
    a_hat = (f_hat * u32).sum(-1)
    f_perp_hat = f_hat - a_hat[..., None] * u32
    n_hat = torch.linalg.vector_norm(f_perp_hat, dim=-1)
    n = m * n_hat
    theta = bound_angle(k * n, theta_max, bound)
    cos_t, sin_t = torch.cos(theta), torch.sin(theta)
    big = n > EPS
    n_hat_safe = torch.where(big, n_hat, 1.0)
    s_hat = torch.where(big, sin_t / n_hat_safe, k * m)
    raw = cos_t[..., None] * u32 + s_hat[..., None] * f_perp_hat
    norm_u = torch.linalg.vector_norm(u32, dim=-1)
    norm_raw = torch.linalg.vector_norm(raw, dim=-1)
    norm_raw_safe = torch.where(norm_raw > 0, norm_raw, 1.0)
    r = norm_u / norm_raw_safe

    # u' = r raw and h = sqrt(d) u' gamma: the total gradient reaching u'.
    gu = torch.zeros_like(u32) if grad_u is None else grad_u.to(ct)
    dgamma = None
    if gamma_next is not None:
        dgamma = torch.zeros(d, dtype=ct, device=u.device)
        if grad_h is not None:
            gh = grad_h.to(ct)
            gu = gu + sqrt_d * gamma_next.to(ct) * gh
            dgamma = (sqrt_d * gh * (r[..., None] * raw)).reshape(-1, d).sum(0)

    # r = ||u|| / ||raw||: d r / d raw = -r raw / ||raw||^2, d r / d u = u / (||u|| ||raw||).
    q = (gu * raw).sum(-1)
    g_raw = r[..., None] * gu - (q * r / norm_raw_safe.square())[..., None] * raw
    norm_u_safe = torch.where(norm_u > 0, norm_u, 1.0)
    du = (q / (norm_raw_safe * norm_u_safe))[..., None] * u32

    # raw = cos(theta) u + s_hat f_perp_hat; gradients with respect to f_hat = f / m.
    g_cos = (g_raw * u32).sum(-1)
    g_s = (g_raw * f_perp_hat).sum(-1)
    g_fperp = s_hat[..., None] * g_raw
    du = du + cos_t[..., None] * g_raw

    # s_hat = sin(theta) / n_hat if n > EPS else k m; theta = bound(k m n_hat).
    g_theta = -sin_t * g_cos + torch.where(big, cos_t / n_hat_safe * g_s, 0.0)
    if grad_theta is not None:
        g_theta = g_theta + grad_theta.to(ct)
    g_k = torch.where(big, 0.0, g_s * m)
    g_n = torch.where(big, -sin_t / n_hat_safe.square() * g_s, 0.0)  # d / d n_hat
    if bound == "rational":  # theta_max^2 / (theta_max + |x|)^2
        g_x = g_theta * (theta_max / (theta_max + (k * n).abs())).square()
    else:
        g_x = g_theta * (1 - (theta / theta_max).square())
    g_k = g_k + g_x * n
    g_n = g_n + g_x * (k * m)

    # n_hat = ||f_perp_hat|| (gradient 0 at 0, as torch's norm); f_perp_hat = f_hat - a_hat u.
    n_pos = torch.where(n_hat > 0, n_hat, 1.0)
    g_fperp = g_fperp + (g_n / n_pos)[..., None] * f_perp_hat
    g_a = -(g_fperp * u32).sum(-1)  # d / d a_hat
    du = du - a_hat[..., None] * g_fperp

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

    # a_hat = <f_hat, u>; f_hat = f / m
    df = (g_fperp + g_a[..., None] * u32) / m[..., None]
    du = du + g_a[..., None] * f_hat
    return (
        du.to(u.dtype), df.to(f.dtype), None if g is None else g_g.to(g.dtype),
        dalpha.to(alpha.dtype).reshape(alpha.shape), dbeta.to(beta.dtype).reshape(beta.shape),
        None if dgamma is None else dgamma.to(gamma_next.dtype),
    )  # fmt: skip
