"""Fused NAG write: Triton forward and backward kernels (DESIGN.md section 2).

The math lives in `reference.py` (the ground truth this file is tested against). Per row: one
max-abs (the power-of-two scale that keeps ||f_perp||^2 from overflowing), one dot product, two
norms of d-vectors, a handful of scalar ops, one renormalisation. Unfused in
PyTorch that is about a dozen kernel launches and as many round trips of a (rows, d) tensor
through memory; here it is one read of (u, f) and one write of (u', h_next) per row, so the aim
is copy bandwidth. (GPU figures: docs/kernels.md; not measured yet.)

Anatomy, as in Liger-Kernel:

- `_nag_write_fwd_kernel`: one row (token) per program, the whole row in one block of
  BLOCK_SIZE = next_power_of_2(d) lanes, fp32 accumulation.
- `_nag_write_bwd_kernel`: recomputes the cheap intermediates (a, n, theta, raw) from (u, f)
  instead of saving them, so the forward saves only its inputs. Each program walks a contiguous
  block of rows and keeps the per-channel gamma gradient and the alpha/beta gradients in
  registers; the host sums the per-program partials (Liger's RMSNorm backward does the same).
- `nag_write_forward` / `nag_write_backward`: host launchers that flatten to (rows, d).
- `ops.py` registers them as the operators `torch.ops.nag_kernels.nag_write` and its backward,
  with the autograd formula tying them together.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .reference import tangent_cutoff

MAX_FUSED_SIZE = 65536
"""Largest d a row can have: the whole row is held in registers (spilling well before this)."""

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreter_active() -> bool:
    """True when Triton runs its CPU interpreter (TRITON_INTERPRET=1 set before import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_nag_write_fwd_kernel, InterpretedFunction)


def calculate_settings(d: int) -> tuple[int, int, int]:
    """BLOCK_SIZE (next power of two >= d) and num_warps for the forward and the backward.

    The warp counts come from ptxas register reports for sm_90 (registers per thread, spills),
    not from timings: the backward holds about eight d-vectors live per row, so it needs more
    warps than the forward to keep them in registers. It spills from d = 8192 on whatever the
    warp count; 32 warps spill least. Retune with benchmarks/bench_nag_write.py on a GPU.
    """
    if d > MAX_FUSED_SIZE:
        raise ValueError(f"nag_write supports d <= {MAX_FUSED_SIZE}, got d={d}.")
    block_size = triton.next_power_of_2(d)
    fwd_warps = 4 if block_size <= 1024 else 8 if block_size <= 4096 else 16 if block_size <= 8192 else 32
    bwd_warps = 4 if block_size <= 512 else 8 if block_size <= 2048 else 16 if block_size <= 4096 else 32
    return block_size, fwd_warps, bwd_warps


@triton.jit
def _tanh(x):
    # tl has no tanh, and libdevice does not run in the interpreter. The exp form cancels for
    # small |x| (1 - e^{-2|x|} loses all digits below ~1e-8), so use the Taylor series there.
    # Series through x^9 at |x| < 0.25: truncation ~1e-8 relative.
    # The series takes 0 outside its range, so a huge x does not overflow x^2 on the unused branch.
    small = tl.abs(x) < 0.25
    xs = tl.where(small, x, 0.0)
    x2 = xs * xs
    series = xs * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(x < 0.0, -t, t)
    return tl.where(small, series, t)


@triton.jit
def _row_scale(f):
    """The largest power of two <= max|f| (1 when max|f| is 0 or subnormal), from the exponent bits
    of max|f|: the reference's `row_scale`. Dividing by it is exact, and the scaled row's sum of
    squares cannot overflow for any finite f."""
    peak = tl.max(tl.abs(f), axis=0)
    m = (peak.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(m > 0.0, m, 1.0)


@triton.jit
def _recompute_row(u, f, g, alpha, theta_in, inv_sqrt_d, theta_max, cutoff, RATIONAL: tl.constexpr,
                   GIVEN: tl.constexpr):
    """The forward of one row up to the renormalisation; shared by both kernels. Works on
    f_hat = f / m (m = _row_scale(f)): a = m a_hat, n = m n_hat, and raw takes s_hat f_perp_hat,
    which is s f_perp with s = sin(theta) / n. `big` is false where f is too small to turn (the
    reference's `too_small_to_turn`, relative to |f_hat|). With GIVEN, theta is theta_in (the
    gated angle) where big, else 0: no turn, and the theta reported is the one applied."""
    m = _row_scale(f)
    f_hat = f / m
    a_hat = tl.sum(f_hat * u, axis=0)
    f_perp_hat = f_hat - a_hat * u
    n_hat = tl.sqrt(tl.sum(f_perp_hat * f_perp_hat, axis=0))
    n = m * n_hat
    k = g * alpha * inv_sqrt_d
    big = n_hat > cutoff * tl.maximum(tl.sqrt(a_hat * a_hat + n_hat * n_hat), 1.0)
    if GIVEN:
        theta = tl.where(big, theta_in, 0.0)
    elif RATIONAL:
        # the reference's two forms: exact for small |x|, |theta| <= theta_max for large
        x = k * n
        denom = theta_max + tl.abs(x)
        far = 1.0 - theta_max / denom
        theta = theta_max * tl.where(tl.abs(x) < theta_max, x / denom, tl.where(x < 0.0, -far, far))
    else:
        theta = theta_max * _tanh(k * n / theta_max)
    cos_t = tl.cos(theta)
    sin_t = tl.sin(theta)
    n_hat_safe = tl.where(big, n_hat, 1.0)
    if GIVEN:
        s_hat = tl.where(big, sin_t / n_hat_safe, 0.0)
    else:
        s_hat = tl.where(big, sin_t / n_hat_safe, k * m)
    raw = cos_t * u + s_hat * f_perp_hat
    norm_u = tl.sqrt(tl.sum(u * u, axis=0))
    norm_raw = tl.sqrt(tl.sum(raw * raw, axis=0))
    norm_raw_safe = tl.where(norm_raw > 0.0, norm_raw, 1.0)
    return (m, f_hat, a_hat, f_perp_hat, n_hat, n, k, big, theta, cos_t, sin_t, s_hat, raw, norm_u,
            norm_raw_safe)


@triton.jit
def _nag_write_fwd_kernel(
    U, F, RHO, G, ALPHA, BETA, GAMMA, ANGLE,  # inputs
    U_OUT, RHO_OUT, THETA_OUT, H_OUT,  # outputs
    n_cols, inv_sqrt_d, sqrt_d, theta_max, cutoff,
    HAS_G: tl.constexpr, HAS_GAMMA: tl.constexpr, RATIONAL: tl.constexpr, GIVEN: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    offs = row * n_cols + cols

    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    f = tl.load(F + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_G:
        g = tl.load(G + row).to(tl.float32)
    else:
        g = 1.0
    alpha = tl.load(ALPHA).to(tl.float32)
    beta = tl.load(BETA).to(tl.float32)
    if GIVEN:
        theta_in = tl.load(ANGLE + row).to(tl.float32)
    else:
        theta_in = 0.0

    m, f_hat, a_hat, f_perp_hat, n_hat, n, k, big, theta, cos_t, sin_t, s_hat, raw, norm_u, norm_raw_safe = (
        _recompute_row(u, f, g, alpha, theta_in, inv_sqrt_d, theta_max, cutoff, RATIONAL, GIVEN)
    )
    u_new = raw * (norm_u / norm_raw_safe)
    tl.store(U_OUT + offs, u_new.to(U_OUT.dtype.element_ty), mask=mask)
    rho = tl.load(RHO + row).to(tl.float32)
    rho_new = rho + g * beta * (m * a_hat) * inv_sqrt_d
    tl.store(RHO_OUT + row, rho_new.to(RHO_OUT.dtype.element_ty))
    tl.store(THETA_OUT + row, theta.to(THETA_OUT.dtype.element_ty))
    if HAS_GAMMA:
        gamma = tl.load(GAMMA + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(H_OUT + offs, (sqrt_d * u_new * gamma).to(H_OUT.dtype.element_ty), mask=mask)


@triton.jit
def _nag_write_bwd_kernel(
    U, F, G, ALPHA, BETA, GAMMA, ANGLE,  # saved inputs
    GU_NEW, GRHO_NEW, GTHETA, GH,  # incoming gradients
    DU, DF, DG, DALPHA, DBETA, DGAMMA, DANGLE,  # DG, DANGLE per row; DALPHA, DBETA, DGAMMA per program
    n_rows, n_cols, rows_per_program, inv_sqrt_d, sqrt_d, theta_max, cutoff,
    HAS_G: tl.constexpr, HAS_GAMMA: tl.constexpr, RATIONAL: tl.constexpr, GIVEN: tl.constexpr,
    HAS_GU: tl.constexpr, HAS_GRHO: tl.constexpr, HAS_GTHETA: tl.constexpr, HAS_GH: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols

    alpha = tl.load(ALPHA).to(tl.float32)
    beta = tl.load(BETA).to(tl.float32)
    if HAS_GAMMA:
        gamma = tl.load(GAMMA + cols, mask=mask, other=0.0).to(tl.float32)
    dgamma_acc = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
    dalpha_acc = 0.0
    dbeta_acc = 0.0

    for row in range(row_start, row_end):
        offs = row * n_cols + cols
        u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
        f = tl.load(F + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_G:
            g = tl.load(G + row).to(tl.float32)
        else:
            g = 1.0
        if GIVEN:
            theta_in = tl.load(ANGLE + row).to(tl.float32)
        else:
            theta_in = 0.0
        (m, f_hat, a_hat, f_perp_hat, n_hat, n, k, big, theta, cos_t, sin_t, s_hat, raw, norm_u,
         norm_raw_safe) = _recompute_row(u, f, g, alpha, theta_in, inv_sqrt_d, theta_max, cutoff, RATIONAL,
                                         GIVEN)
        r = norm_u / norm_raw_safe

        # u' = r * raw, h = sqrt(d) * u' * gamma: total gradient reaching u'.
        if HAS_GU:
            gu = tl.load(GU_NEW + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            gu = tl.zeros((BLOCK_SIZE,), dtype=tl.float32)
        if HAS_GH:
            gh = tl.load(GH + offs, mask=mask, other=0.0).to(tl.float32)
            gu += sqrt_d * gamma * gh
            dgamma_acc += sqrt_d * gh * (r * raw)

        # r = ||u|| / ||raw||: d r / d raw = -r raw / ||raw||^2, d r / d u = u / (||u|| ||raw||).
        # (When ||raw|| = 0, raw = 0 and q = 0, so these terms vanish as in the reference.)
        q = tl.sum(gu * raw, axis=0)
        g_raw = r * gu - (q * r / (norm_raw_safe * norm_raw_safe)) * raw
        norm_u_safe = tl.where(norm_u > 0.0, norm_u, 1.0)
        du = (q / (norm_raw_safe * norm_u_safe)) * u

        # Gradients are taken with respect to the scaled row f_hat = f / m (m a constant), so no
        # intermediate grows with |f|; df = g_fhat / m at the end.
        # raw = cos(theta) u + s_hat f_perp_hat
        g_cos = tl.sum(g_raw * u, axis=0)
        g_s = tl.sum(g_raw * f_perp_hat, axis=0)
        g_fperp = s_hat * g_raw
        du += cos_t * g_raw

        # s_hat = sin(theta) / n_hat where big, else k m; theta = bound(k m n_hat), with
        # dtheta/d(kn) = 1 - tanh^2 (tanh) or (1 - |theta| / theta_max)^2 (rational).
        n_hat_safe = tl.where(big, n_hat, 1.0)
        g_theta = -sin_t * g_cos + tl.where(big, cos_t / n_hat_safe * g_s, 0.0)
        if HAS_GTHETA:
            g_theta += tl.load(GTHETA + row).to(tl.float32)
        g_n = tl.where(big, -sin_t / (n_hat_safe * n_hat_safe) * g_s, 0.0)  # d / d n_hat
        if GIVEN:  # theta is an input: nothing of it depends on k (alpha, g) or on n
            tl.store(DANGLE + row, tl.where(big, g_theta, 0.0))  # theta = 0 where not big
            g_k = 0.0
        else:
            g_k = tl.where(big, 0.0, g_s * m)
            if RATIONAL:  # theta_max^2 / (theta_max + |x|)^2, no cancellation as theta -> theta_max
                r = theta_max / (theta_max + tl.abs(k * n))
                g_traw = g_theta * r * r
            else:
                t = theta / theta_max
                g_traw = g_theta * (1.0 - t * t)
            g_k += g_traw * n
            g_n += g_traw * (k * m)

        # n_hat = ||f_perp_hat|| (gradient 0 at 0, as torch's norm), f_perp_hat = f_hat - a_hat u.
        n_pos = tl.where(n_hat > 0.0, n_hat, 1.0)
        g_fperp += (g_n / n_pos) * f_perp_hat
        g_a = -tl.sum(g_fperp * u, axis=0)  # d / d a_hat
        du += -a_hat * g_fperp
        df = g_fperp

        # rho' = rho + g beta m a_hat / sqrt(d)
        g_g = g_k * alpha * inv_sqrt_d
        if HAS_GRHO:
            grho = tl.load(GRHO_NEW + row).to(tl.float32)
            a = m * a_hat
            g_a += grho * g * beta * m * inv_sqrt_d
            g_g += grho * beta * a * inv_sqrt_d
            dbeta_acc += grho * g * a * inv_sqrt_d
        dalpha_acc += g_k * g * inv_sqrt_d

        # a_hat = <f_hat, u>
        df += g_a * u
        du += g_a * f_hat
        df = df / m

        tl.store(DU + offs, du.to(DU.dtype.element_ty), mask=mask)
        tl.store(DF + offs, df.to(DF.dtype.element_ty), mask=mask)
        if HAS_G:
            tl.store(DG + row, g_g)

    tl.store(DALPHA + pid, dalpha_acc)
    tl.store(DBETA + pid, dbeta_acc)
    if HAS_GAMMA:
        tl.store(DGAMMA + pid * n_cols + cols, dgamma_acc, mask=mask)


def _check_kernel_inputs(u, f, rho, g, alpha, beta, gamma_next) -> None:
    for name, t in (("u", u), ("f", f)):
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"nag_write's Triton kernel takes fp32, bf16 or fp16 {name}, got {t.dtype}.")
    named = (("f", f), ("rho", rho), ("g", g), ("alpha", alpha), ("beta", beta), ("gamma_next", gamma_next))
    for name, t in named:
        if t is not None and t.device != u.device:
            raise ValueError(f"nag_write: {name} is on {t.device} but u is on {u.device}.")
    if not u.is_cuda and not interpreter_active():
        raise RuntimeError(
            "backend='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
            "imported to run the kernel in Triton's CPU interpreter."
        )


def nag_write_forward(u, f, rho, g, alpha, beta, theta_max, gamma_next, bound="tanh", angle=None):
    """Launch the forward. Returns the outputs (in the input shapes) and the 2-D tensors to save."""
    _check_kernel_inputs(u, f, rho, g, alpha, beta, gamma_next)
    shape = u.shape
    d = shape[-1]
    u2 = u.reshape(-1, d).contiguous()  # (rows, d)
    f2 = f.reshape(-1, d).contiguous()
    n_rows = u2.shape[0]
    rho1 = rho.reshape(-1).contiguous()  # (rows,)
    g1 = None if g is None else g.reshape(-1).contiguous()
    angle1 = None if angle is None else angle.reshape(-1).contiguous()
    gamma = None if gamma_next is None else gamma_next.contiguous()
    alpha, beta = alpha.reshape(()).contiguous(), beta.reshape(()).contiguous()

    u_new = torch.empty_like(u2)
    rho_new = torch.empty_like(rho1)
    theta = torch.empty_like(rho1)
    h_next = None if gamma is None else torch.empty_like(u2)
    block_size, num_warps, _ = calculate_settings(d)
    if n_rows > 0:
        _nag_write_fwd_kernel[(n_rows,)](
            u2, f2, rho1, g1, alpha, beta, gamma, angle1,
            u_new, rho_new, theta, h_next,
            d, 1.0 / math.sqrt(d), math.sqrt(d), float(theta_max), tangent_cutoff(f2.dtype),
            HAS_G=g1 is not None, HAS_GAMMA=gamma is not None, RATIONAL=bound == "rational",
            GIVEN=angle1 is not None, BLOCK_SIZE=block_size, num_warps=num_warps,
        )  # fmt: skip
    outs = (
        u_new.view(shape),
        rho_new.view(shape[:-1]),
        theta.view(shape[:-1]),
        None if h_next is None else h_next.view(shape),
    )
    return outs, (u2, f2, g1, alpha, beta, gamma, angle1)


def _num_programs(n_rows: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, 4 * sms))
    return max(1, min(n_rows, 4))  # the interpreter: few programs, several rows each


def nag_write_backward(saved, theta_max, grads, bound="tanh"):
    """Launch the backward. Returns 2-D/1-D gradients for (u, f, g, alpha, beta, gamma_next, angle)."""
    u2, f2, g1, alpha, beta, gamma, angle1 = saved
    gu, grho, gtheta, gh = grads
    n_rows, d = u2.shape
    gu = None if gu is None else gu.reshape(n_rows, d).contiguous()
    gh = None if gh is None else gh.reshape(n_rows, d).contiguous()
    grho = None if grho is None else grho.reshape(n_rows).contiguous()
    gtheta = None if gtheta is None else gtheta.reshape(n_rows).contiguous()

    du = torch.empty_like(u2)
    df = torch.empty_like(f2)
    dg = None if g1 is None else torch.empty(n_rows, dtype=torch.float32, device=u2.device)
    dangle = None if angle1 is None else torch.empty(n_rows, dtype=torch.float32, device=u2.device)
    n_prog = _num_programs(n_rows, u2.device)
    rows_per_program = triton.cdiv(n_rows, n_prog)
    n_prog = triton.cdiv(n_rows, rows_per_program) if n_rows > 0 else 1
    dalpha = torch.zeros(n_prog, dtype=torch.float32, device=u2.device)
    dbeta = torch.zeros(n_prog, dtype=torch.float32, device=u2.device)
    dgamma = None if gamma is None else torch.zeros(n_prog, d, dtype=torch.float32, device=u2.device)
    block_size, _, num_warps = calculate_settings(d)
    if n_rows > 0:
        _nag_write_bwd_kernel[(n_prog,)](
            u2, f2, g1, alpha, beta, gamma, angle1,
            gu, grho, gtheta, gh,
            du, df, dg, dalpha, dbeta, dgamma, dangle,
            n_rows, d, rows_per_program, 1.0 / math.sqrt(d), math.sqrt(d), float(theta_max),
            tangent_cutoff(f2.dtype),
            HAS_G=g1 is not None, HAS_GAMMA=gamma is not None, RATIONAL=bound == "rational",
            GIVEN=angle1 is not None,
            HAS_GU=gu is not None, HAS_GRHO=grho is not None,
            HAS_GTHETA=gtheta is not None, HAS_GH=gh is not None,
            BLOCK_SIZE=block_size, num_warps=num_warps,
        )  # fmt: skip
    dg = None if dg is None else dg.to(g1.dtype)
    dalpha = dalpha.sum().to(alpha.dtype)
    dbeta = dbeta.sum().to(beta.dtype)
    dgamma = None if dgamma is None else dgamma.sum(0).to(gamma.dtype)
    dangle = None if dangle is None else dangle.to(angle1.dtype)
    return du, df, dg, dalpha, dbeta, dgamma, dangle

