"""The NAG write as registered PyTorch operators: `torch.ops.nag_kernels.nag_write` and its backward.

Registering the write with `torch.library` (rather than calling an `autograd.Function`) makes it
an operator like any other: `torch.compile` puts one node in the graph instead of tracing into it
(no graph break, no retracing of the Triton launch), AOTAutograd and FSDP see a single op with a
registered backward, and fake tensors know its output shapes without running it.

    nag_write(u, f, rho, g?, alpha, beta, theta_max, gamma_next?, bound, fused, angle?)
        -> (u_new, rho_new, theta, h_next, rows)      h_next is empty (0,) without gamma_next; rows,
                                                      the reference's per-row numbers (..., 4) for
                                                      its backward, empty from the kernels
    nag_write_backward(u, f, g?, alpha, beta, theta_max, gamma_next?, bound, fused,
                       grad_u?, grad_rho?, grad_theta?, grad_h?, rows?, angle?)
        -> (du, df, dg, dalpha, dbeta, dgamma, dangle)   dg, dgamma, dangle empty without g,
                                                         gamma_next, angle

`angle`, given, is the angle each row turns by (the gated NAG), in place of the bounded size of
the sublayer's tangential output.

`fused` picks the implementation: the Triton kernels of `nag_write.py` (CUDA tensors, or CPU
tensors under TRITON_INTERPRET=1) or the PyTorch reference, with the kernel's backward formulas
in PyTorch (`reference_backward.py`). `nag_kernels.nag_write` chooses it from the
backend and the device (CUDA means fused), so on a GPU the op runs the kernels and on CPU the
reference. Both save the inputs for backward, and the reference its 16 bytes a token of per-row
numbers.

Custom operators cannot return None, so an absent optional output is an empty tensor here; the
public `nag_kernels.nag_write` turns it back into None.

Where the kernels do not run (`fused` false: CPU, or `backend="torch"`), `nag_kernels.nag_write`
calls `TracedNagWrite` instead of the operator: the same reference forward and backward formulas
as an `autograd.Function`. Under `torch.compile` dynamo traces it into ordinary tensor operations,
forward and backward, that inductor fuses with the sublayer's neighbours, where the opaque
operator ran as a dozen separate kernels; in eager mode it skips the operator's dispatch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import compiled as _compiled
from .reference import _compute_dtype, nag_write_reference
from .reference_backward import nag_write_reference_backward

try:
    from .nag_write import nag_write_backward as _fused_backward
    from .nag_write import nag_write_forward as _fused_forward
except ImportError:  # no triton: the reference still works
    _fused_forward = _fused_backward = None

FORWARD = "nag_kernels::nag_write"
BACKWARD = "nag_kernels::nag_write_backward"


def _absent(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _detached(values: tuple) -> tuple:
    return tuple(v.detach() if isinstance(v, Tensor) else v for v in values)


def _need_triton() -> None:
    if _fused_forward is None:
        raise ImportError("backend='triton' needs the triton package, which is not installed.")


@torch.library.custom_op(FORWARD, mutates_args=())
def nag_write_op(
    u: Tensor, f: Tensor, rho: Tensor, g: Tensor | None, alpha: Tensor, beta: Tensor,
    theta_max: float, gamma_next: Tensor | None, bound: str, fused: bool, angle: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    if fused:
        _need_triton()
        outs, _ = _fused_forward(u, f, rho, g, alpha, beta, theta_max, gamma_next, bound, angle)
        rows = _absent(u)  # the backward kernel recomputes its rows in registers
    else:
        outs, rows = nag_write_reference(
            u, f, rho, g, alpha, beta, theta_max, gamma_next, bound, True, angle=angle
        )
    u_new, rho_new, theta, h_next = outs
    if h_next is None:
        h_next = _absent(u)
    # contiguous, as the fake implementation promises, whatever the inputs' strides
    return tuple(t.contiguous() for t in (u_new, rho_new, theta, h_next, rows))


@nag_write_op.register_fake
def _(u, f, rho, g, alpha, beta, theta_max, gamma_next, bound, fused, angle=None):
    h_next = _absent(u) if gamma_next is None else u.new_empty(u.shape)
    rows = _absent(u) if fused else u.new_empty((*rho.shape, 4), dtype=_compute_dtype(u.dtype))
    return u.new_empty(u.shape), rho.new_empty(rho.shape), rho.new_empty(rho.shape), h_next, rows


@torch.library.custom_op(BACKWARD, mutates_args=())
def nag_write_backward_op(
    u: Tensor, f: Tensor, g: Tensor | None, alpha: Tensor, beta: Tensor,
    theta_max: float, gamma_next: Tensor | None, bound: str, fused: bool,
    grad_u: Tensor | None, grad_rho: Tensor | None, grad_theta: Tensor | None, grad_h: Tensor | None,
    rows: Tensor | None = None, angle: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    grads = (grad_u, grad_rho, grad_theta, grad_h)
    if fused:
        _need_triton()
        d = u.shape[-1]
        saved = (  # what the kernel's forward saves: 2-D rows, flat gate, 0-dim gains
            u.reshape(-1, d).contiguous(), f.reshape(-1, d).contiguous(),
            None if g is None else g.reshape(-1).contiguous(),
            alpha.reshape(()).contiguous(), beta.reshape(()).contiguous(),
            None if gamma_next is None else gamma_next.contiguous(),
            None if angle is None else angle.reshape(-1).contiguous(),
        )  # fmt: skip
        du, df, dg, dalpha, dbeta, dgamma, dangle = _fused_backward(saved, theta_max, grads, bound)
        du, df = du.view(u.shape), df.view(f.shape)
        dg = None if dg is None else dg.view(g.shape)
        dalpha, dbeta = dalpha.view(alpha.shape), dbeta.view(beta.shape)
    else:
        du, df, dg, dalpha, dbeta, dgamma, dangle = nag_write_reference_backward(
            u, f, g, alpha, beta, theta_max, gamma_next, bound, *grads,
            rows=None if rows is None or rows.numel() == 0 else rows, angle=angle,
        )
    outs = (du, df, dg, dalpha, dbeta, dgamma, dangle)
    like = (u, f, g, alpha, beta, gamma_next, angle)
    return tuple(_absent(u) if t is None else t.contiguous().view(x.shape) for t, x in zip(outs, like))


@nag_write_backward_op.register_fake
def _(u, f, g, alpha, beta, theta_max, gamma_next, bound, fused, grad_u, grad_rho, grad_theta, grad_h,
      rows=None, angle=None):
    like = (u, f, g, alpha, beta, gamma_next, angle)
    return tuple(_absent(u) if t is None else t.new_empty(t.shape) for t in like)


def _setup_context(ctx, inputs, output) -> None:
    u, f, rho, g, alpha, beta, theta_max, gamma_next, bound, fused, *angle = inputs
    angle = angle[0] if angle else None
    rows = output[4]  # the reference's per-row numbers (empty for the kernels): 16 bytes a token
    ctx.save_for_backward(u, f, g, alpha, beta, gamma_next, rows, angle)
    ctx.theta_max, ctx.bound, ctx.fused, ctx.rho_dtype = theta_max, bound, fused, rho.dtype
    # Outputs that do not reach the loss (theta, usually) give None, and the kernel skips loading them.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_u, grad_rho, grad_theta, grad_h, grad_rows):
    u, f, g, alpha, beta, gamma_next, rows, angle = ctx.saved_tensors
    if gamma_next is None:
        grad_h = None  # the empty placeholder output
    if all(t is None for t in (grad_u, grad_rho, grad_theta, grad_h)):
        return (None,) * 11
    du, df, dg, dalpha, dbeta, dgamma, dangle = nag_write_backward_op(
        u, f, g, alpha, beta, ctx.theta_max, gamma_next, ctx.bound, ctx.fused,
        grad_u, grad_rho, grad_theta, grad_h, rows, angle,
    )  # fmt: skip
    # rho' = rho + (terms without rho): its gradient passes straight through.
    drho = None if grad_rho is None else grad_rho.to(ctx.rho_dtype)
    return (du, df, drho, None if g is None else dg, dalpha, dbeta, None,
            None if gamma_next is None else dgamma, None, None,
            None if angle is None else dangle)  # fmt: skip


nag_write_op.register_autograd(_backward, setup_context=_setup_context)


class TracedNagWrite(torch.autograd.Function):
    """The PyTorch path of `nag_write_op` as plain tensor operations for the compiler to trace:
    the reference forward, its per-row numbers saved, and `reference_backward`'s formulas, so
    values and gradients are the operator's and only fusion changes their rounding. Same
    arguments as `nag_write_op` with `compiled` for `fused`: "wait" or "background" runs both
    formulas compiled by inductor (`compiled.py`, eager mode), compiled before the first call or
    once the background compilation is ready; None runs them as written. Returns (u_new, rho_new,
    theta, h_next), h_next empty without gamma_next."""

    @staticmethod
    def forward(ctx, u, f, rho, g, alpha, beta, theta_max, gamma_next, bound, angle, compiled=None):
        with torch.autocast(u.device.type, enabled=False):  # the write computes in fp32 itself
            args = (u, f, rho, g, alpha, beta, theta_max, gamma_next, bound, True)
            if compiled:
                # detached: a compiled function is not compiled again for each requires_grad (gated.py)
                args, angle = _detached(args), _detached((angle,))[0]
                outs, rows = _compiled.call(nag_write_reference, *args, wait=compiled == "wait", angle=angle)
            else:
                outs, rows = nag_write_reference(*args, angle=angle)
        ctx.save_for_backward(u, f, g, alpha, beta, gamma_next, rows, angle)
        ctx.theta_max, ctx.bound, ctx.rho_dtype, ctx.compiled = theta_max, bound, rho.dtype, compiled
        ctx.set_materialize_grads(False)  # rho's gradient stays None where rho' is unused, as the op's
        u_new, rho_new, theta, h_next = outs
        return u_new, rho_new, theta, _absent(u) if h_next is None else h_next

    @staticmethod
    def backward(ctx, grad_u, grad_rho, grad_theta, grad_h):
        u, f, g, alpha, beta, gamma_next, rows, angle = ctx.saved_tensors
        # zeros for the other unused outputs: the formulas then round as the gradcheck expects
        grad_u = torch.zeros_like(u) if grad_u is None else grad_u
        grad_theta = torch.zeros_like(u[..., 0]) if grad_theta is None else grad_theta
        if gamma_next is not None and grad_h is None:
            grad_h = torch.zeros_like(u)
        args = (u, f, g, alpha, beta, ctx.theta_max, gamma_next, ctx.bound,
                grad_u, grad_rho, grad_theta, None if gamma_next is None else grad_h)
        with torch.autocast(u.device.type, enabled=False):
            if ctx.compiled:
                args, rows, angle = _detached(args), rows.detach(), _detached((angle,))[0]
                grads = _compiled.call(
                    nag_write_reference_backward, *args, wait=ctx.compiled == "wait", rows=rows, angle=angle
                )
            else:
                grads = nag_write_reference_backward(*args, rows=rows, angle=angle)
        du, df, dg, dalpha, dbeta, dgamma, dangle = grads
        drho = None if grad_rho is None else grad_rho.to(ctx.rho_dtype)
        return du, df, drho, dg, dalpha, dbeta, None, dgamma, None, dangle, None
