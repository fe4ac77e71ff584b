"""The NAG write as a torch.library operator: opcheck, and torch.compile without a graph break.

`torch.library.opcheck` checks the schema (no mutation, no aliasing), the autograd registration,
the fake implementation against the real one (shapes, dtypes, strides) and AOTAutograd's tracing
of forward and backward with dynamic shapes. On CPU the operator runs the PyTorch reference; the
Triton path runs under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import pytest
import torch

import nag_kernels
from nag_kernels import BOUNDS, nag_write, nag_write_backward_op, nag_write_op

HAS_TRITON = nag_kernels._triton_ops is not None
if HAS_TRITON:
    from nag_kernels.nag_write import interpreter_active

    KERNEL_RUNS = interpreter_active() or torch.cuda.is_available()
else:
    KERNEL_RUNS = False


def op_args(*, gate: bool, gamma: bool, bound: str, fused: bool = False, dtype=torch.float32, seed=0):
    """(u, f, rho, g, alpha, beta, theta_max, gamma_next, bound, fused) for a (2, 3, 8) write, with
    one row of f parallel to u (the small-tangent branch)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(2, 3, 8, generator=gen, dtype=dtype), dim=-1)
    f = 3 * torch.randn(2, 3, 8, generator=gen, dtype=dtype)
    f[0, 0] = 2 * u[0, 0]
    g = torch.rand(2, 3, generator=gen, dtype=dtype) if gate else None
    gamma_next = torch.rand(8, generator=gen, dtype=dtype) + 0.5 if gamma else None
    rho = torch.randn(2, 3, generator=gen, dtype=dtype)
    alpha, beta = torch.tensor(0.8, dtype=dtype), torch.tensor(0.3, dtype=dtype)
    leaves = [t.requires_grad_() if t is not None else None for t in (u, f, rho, g, alpha, beta, gamma_next)]
    u, f, rho, g, alpha, beta, gamma_next = leaves
    return (u, f, rho, g, alpha, beta, math.pi / 4, gamma_next, bound, fused)


@pytest.mark.parametrize("bound", BOUNDS)
@pytest.mark.parametrize("gate", [False, True], ids=["no_gate", "gate"])
@pytest.mark.parametrize("gamma", [False, True], ids=["no_gamma", "gamma"])
def test_opcheck_reference(bound, gate, gamma):
    torch.library.opcheck(nag_write_op, op_args(gate=gate, gamma=gamma, bound=bound))


@pytest.mark.parametrize("bound", BOUNDS)
def test_opcheck_backward(bound):
    u, f, rho, g, alpha, beta, theta_max, gamma_next, _, fused = op_args(gate=True, gamma=True, bound=bound)
    detached = [t.detach() for t in (u, f, g, alpha, beta)]
    grads = (torch.randn_like(u), torch.randn_like(rho), None, torch.randn_like(u))  # theta unused
    torch.library.opcheck(
        nag_write_backward_op, (*detached, theta_max, gamma_next.detach(), bound, fused, *grads)
    )
    rows = nag_write_op(*[t.detach() if isinstance(t, torch.Tensor) else t
                          for t in (u, f, rho, g, alpha, beta, theta_max, gamma_next, bound, fused)])[4]
    torch.library.opcheck(
        nag_write_backward_op, (*detached, theta_max, gamma_next.detach(), bound, fused, *grads, rows)
    )


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_opcheck_given_angle(fused):
    """The gated NAG's write: the angle is an input with a gradient, forward and backward ops."""
    if fused and not KERNEL_RUNS:
        pytest.skip("needs triton with CUDA or TRITON_INTERPRET=1")
    args = op_args(gate=True, gamma=True, bound="tanh", fused=fused)
    angle = torch.rand(2, 3, generator=torch.Generator().manual_seed(1)).requires_grad_()
    torch.library.opcheck(nag_write_op, (*args, angle))
    u, f, rho, g, alpha, beta, theta_max, gamma_next, bound, _ = args
    detached = [t.detach() for t in (u, f, g, alpha, beta)]
    grads = (torch.randn_like(u), torch.randn_like(rho), torch.randn_like(rho), torch.randn_like(u))
    torch.library.opcheck(
        nag_write_backward_op,
        (*detached, theta_max, gamma_next.detach(), bound, fused, *grads, None, angle.detach()),
    )


@pytest.mark.skipif(not KERNEL_RUNS, reason="needs triton with CUDA or TRITON_INTERPRET=1")
def test_opcheck_fused():
    device = "cuda" if torch.cuda.is_available() and not interpreter_active() else "cpu"
    args = op_args(gate=True, gamma=True, bound="tanh", fused=True)
    args = tuple(t.detach().to(device).requires_grad_() if isinstance(t, torch.Tensor) else t for t in args)
    torch.library.opcheck(nag_write_op, args)


def write_and_loss(u, f, rho, g, alpha, beta):
    u_new, rho_new, theta, _ = nag_write(u, f, rho, g, alpha, beta, 0.5, backend="torch")
    return (u_new * torch.arange(8.0)).sum() + rho_new.square().sum() + theta.sum()


def test_compile_traces_the_write_into_plain_operations():
    """Off the kernels, torch.compile traces the write (forward and backward) as ordinary tensor
    operations inductor can fuse: no graph break, no opaque operator, and the gradients of the
    operator's own backward."""
    args = op_args(gate=True, gamma=False, bound="tanh")
    u, f, rho, g, alpha, beta = (args[i] for i in range(6))
    explanation = torch._dynamo.explain(write_and_loss)(u, f, rho, g, alpha, beta)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    targets = {str(node.target) for gm in explanation.graphs for node in gm.graph.nodes}
    assert not any("nag_kernels" in t for t in targets), targets

    torch._dynamo.reset()
    compiled = torch.compile(write_and_loss, backend="aot_eager", fullgraph=True)
    loss = compiled(u, f, rho, g, alpha, beta)
    compiled_grads = torch.autograd.grad(loss, (u, f, rho, g, alpha, beta))
    outs = nag_write_op(*args[:6], 0.5, *args[7:])  # write_and_loss's theta_max
    weights = torch.arange(8.0)
    op_loss = (outs[0] * weights).sum() + outs[1].square().sum() + outs[2].sum()
    op_grads = torch.autograd.grad(op_loss, (u, f, rho, g, alpha, beta))
    for got, want in zip(compiled_grads, op_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("n", [1e-2, 1e-5, 1e-7])
def test_op_backward_is_as_accurate_as_autograd_at_small_tangents(n):
    """Against float64, the operator's float32 gradients are no worse than autograd's through the
    reference in float32, down to tangents below EPS (where f nearly parallel to u makes any
    formula that subtracts <f,u>^2 from ||f||^2 lose every digit)."""
    gen = torch.Generator().manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(64, 128, generator=gen, dtype=torch.float64), dim=-1)
    perp = torch.randn(64, 128, generator=gen, dtype=torch.float64)
    perp -= (perp * u).sum(-1, keepdim=True) * u
    f = 2 * u + n * perp / perp.norm(dim=-1, keepdim=True)
    inputs = (u, f, torch.zeros(64, dtype=torch.float64), torch.rand(64, generator=gen, dtype=torch.float64),
              torch.tensor(0.8, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64))  # fmt: skip

    def grads(fn, dtype):
        xs = [t.to(dtype).requires_grad_() for t in inputs]
        u_new, rho_new, theta, _ = fn(*xs, 0.5)
        weights = torch.linspace(-1, 1, 128, dtype=dtype)
        loss = (u_new * weights).sum() + 0.7 * rho_new.sum() + 0.3 * theta.sum()
        return torch.autograd.grad(loss, xs)

    exact = grads(nag_kernels.nag_write_reference, torch.float64)
    by_autograd = grads(nag_kernels.nag_write_reference, torch.float32)
    by_op = grads(lambda *a: nag_write(*a, backend="torch"), torch.float32)
    for name, want, ref, got in zip(("u", "f", "rho", "g", "alpha", "beta"), exact, by_autograd, by_op):
        scale = want.abs().max().clamp_min(1e-12)
        err_ref = (ref.double() - want).abs().max() / scale
        err_op = (got.double() - want).abs().max() / scale
        assert err_op <= 2 * err_ref + 1e-6, (name, float(err_op), float(err_ref))


@pytest.mark.parametrize("bound", BOUNDS)
def test_the_backward_from_the_forwards_rows_equals_the_recomputed_one(bound):
    """The per-row numbers the reference's forward keeps give the same gradients as recomputing
    them (they are the same numbers), so saving them changes time, not results."""
    from nag_kernels.reference import nag_write_reference
    from nag_kernels.reference_backward import nag_write_reference_backward

    u, f, rho, g, alpha, beta, theta_max, gamma_next, _, _ = op_args(gate=True, gamma=True, bound=bound)
    detached = [t.detach() for t in (u, f, g, alpha, beta)]
    _, rows = nag_write_reference(*[t.detach() for t in (u, f, rho, g, alpha, beta)], theta_max,
                                  gamma_next.detach(), bound, return_rows=True)
    assert rows.shape == (2, 3, 4)
    grads = (torch.randn_like(u), torch.randn_like(rho), torch.randn_like(rho), torch.randn_like(u))
    args = (*detached, theta_max, gamma_next.detach(), bound, *grads)
    recomputed = nag_write_reference_backward(*args)
    saved = nag_write_reference_backward(*args, rows=rows)
    for a, b in zip(recomputed, saved):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
