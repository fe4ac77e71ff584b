"""The gated NAG write, its angle computed inside the write, for eager writes on CPU.

NAG's default angle is learned by a gate on the token's own direction (nag_lightning's
`residuals/nag.py`): per row,

    angle = theta_max * sigmoid(gain <u, w> + b) * g        g the router's gate (1 without one)

and, with `radial`, angle / theta_max also gates the radial update (it is the write's g). Computed
in eager PyTorch before the write, the angle is a dot product over u, and its backward an outer
product added into du and a column reduction for w: a dozen passes and small operations beside a
write that inductor compiled into a few loops, about a fifth of their time together (one write,
forward and backward, at 2048 rows of 128: 2.37 ms with the angle in eager PyTorch, 1.88 with it
compiled in; docs/benchmarks.md). Here the angle's formulas join
the write's compiled forward and backward (`compiled.call`), so the dot product becomes one more
row reduction of the loop that reads u, and the outer product one more term of du's.

`gated_write_forward` and `gated_write_backward` are those formulas, in plain PyTorch around the
reference write and its backward; `GatedNagWrite` runs them compiled. `nag_kernels.gated_nag_write`
takes this path where `nag_write` would take the compiled write; elsewhere it computes the angle
with `gated_angle` and calls `nag_write` with it (the Triton kernel, the reference, a compiled
model), so both paths have the same values and gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import compiled as _compiled
from .reference import nag_write_reference
from .reference_backward import nag_write_reference_backward


def gated_angle(u: Tensor, w: Tensor, b: Tensor, theta_max: float | Tensor, gain: float) -> Tensor:
    """theta_max * sigmoid(gain <u, w> + b) per row of u (..., d), in fp32: the gated angle before
    any router's gate. fp32 under autocast too, which would run the dot product in bf16."""
    with torch.autocast(u.device.type, enabled=False):
        return theta_max * torch.sigmoid(gain * (u.float() @ w.float()) + b.float())


def gated_write_forward(
    u: Tensor, f: Tensor, rho: Tensor, g: Tensor | None, alpha: Tensor, beta: Tensor, theta_max: float | Tensor,
    bound: str, w: Tensor, b: Tensor, gain: float, radial: bool,
) -> tuple[tuple[Tensor, Tensor, Tensor, Tensor], Tensor, Tensor]:  # fmt: skip
    """((u_new, rho_new, theta, angle), rows, base): the write turned by the gated angle, the
    angle itself (..., in fp32), the reference's per-row numbers and the angle before g (`base`),
    which the backward reads."""
    base = gated_angle(u, w, b, theta_max, gain)
    angle = base if g is None else base * g.float()
    (u_new, rho_new, theta, _), rows = nag_write_reference(
        u, f, rho, angle / theta_max if radial else g, alpha, beta, theta_max, None, bound, True, angle=angle
    )
    return (u_new, rho_new, theta, angle), rows, base


def gated_write_backward(
    u: Tensor, f: Tensor, g: Tensor | None, alpha: Tensor, beta: Tensor, theta_max: float | Tensor, bound: str,
    w: Tensor, b: Tensor, gain: float, radial: bool, base: Tensor, rows: Tensor,
    grad_u: Tensor, grad_rho: Tensor | None, grad_theta: Tensor, grad_angle: Tensor,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """(du, df, dg, dalpha, dbeta, dw, db) from the gradients of (u_new, rho_new, theta, angle);
    dg is None without g. The write's own backward gives the gradient of the angle it turned by
    and of its g; the chain rule then goes through the sigmoid and the dot product."""
    angle = base if g is None else base * g.float()
    write_gate = angle / theta_max if radial else g
    du, df, d_write_gate, dalpha, dbeta, _, d_angle = nag_write_reference_backward(
        u, f, write_gate, alpha, beta, theta_max, None, bound, grad_u, grad_rho, grad_theta, None,
        rows=rows, angle=angle,
    )  # fmt: skip
    d_angle = d_angle.float() + grad_angle.float()
    dg = None
    if radial:
        d_angle = d_angle + d_write_gate.float() / theta_max
    elif g is not None:
        dg = d_write_gate.float()
    d_base = d_angle
    if g is not None:
        d_base = d_angle * g.float()
        dg = d_angle * base if dg is None else dg + d_angle * base
    d_score = d_base * base * (1 - base / theta_max)  # sigmoid' = sigmoid (1 - sigmoid)
    du = torch.addcmul(du.float(), d_score[..., None], gain * w.float())
    dw = gain * (d_score.reshape(1, -1) @ u.reshape(-1, u.shape[-1]).float()).squeeze(0)
    db = d_score.sum()
    return (
        du.to(u.dtype), df, None if g is None else dg.to(g.dtype), dalpha, dbeta,
        dw.to(w.dtype), db.to(b.dtype).reshape(b.shape),
    )  # fmt: skip


class GatedNagWrite(torch.autograd.Function):
    """The gated write, forward and backward each one compiled function (`compiled.call`).
    apply(u, f, rho, g, alpha, beta, w, b, theta_max, bound, gain, radial, wait)
    -> (u_new, rho_new, theta, angle); `wait` as `compiled.call`'s."""

    @staticmethod
    def forward(ctx, u, f, rho, g, alpha, beta, w, b, theta_max, bound, gain, radial, wait=True):
        # The compiled functions see detached tensors, a gate of ones for none and zeros for an
        # unused gradient, so that they are compiled for the few variants that change their
        # formulas (radial, dtypes), not for every combination of requires_grad and None:
        # dynamo compiles a function at most 8 times, then runs it uncompiled.
        ctx.g_given = g is not None
        g = torch.ones_like(rho, dtype=torch.float) if g is None else g
        inputs = [t.detach() for t in (u, f, rho, g, alpha, beta)]
        # The bound goes in as a tensor: as a constant, each sublayer's own bound (the decaying
        # schedule gives each one its own) would be a setting of its own, compiled once per sublayer.
        theta_max = torch.tensor(float(theta_max), dtype=torch.float32, device=u.device)
        with torch.autocast(u.device.type, enabled=False):  # the write computes in fp32 itself
            outs, rows, base = _compiled.call(
                gated_write_forward, *inputs, theta_max, bound, w.detach(), b.detach(), gain, radial, wait=wait
            )
        ctx.save_for_backward(u, f, g, alpha, beta, w, b, base, rows)
        ctx.settings = (theta_max, bound, gain, radial)
        ctx.wait = wait
        ctx.rho_dtype = rho.dtype
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, grad_u, grad_rho, grad_theta, grad_angle):
        u, f, g, alpha, beta, w, b, base, rows = (t.detach() for t in ctx.saved_tensors)
        theta_max, bound, gain, radial = ctx.settings
        zeros = torch.zeros_like(base)
        grads = (
            torch.zeros_like(u) if grad_u is None else grad_u,
            zeros if grad_rho is None else grad_rho,
            zeros if grad_theta is None else grad_theta,
            zeros if grad_angle is None else grad_angle,
        )  # fmt: skip
        with torch.autocast(u.device.type, enabled=False):
            du, df, dg, dalpha, dbeta, dw, db = _compiled.call(
                gated_write_backward, u, f, g, alpha, beta, theta_max, bound, w, b, gain, radial, base,
                rows, *grads, wait=ctx.wait,
            )  # fmt: skip
        drho = None if grad_rho is None else grad_rho.to(ctx.rho_dtype)
        dg = dg if ctx.g_given else None
        return du, df, drho, dg, dalpha, dbeta, dw, db, None, None, None, None, None
