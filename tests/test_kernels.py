"""nag_kernels: the fused Triton NAG write against its pure-PyTorch reference.

On CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so
these tests execute the real kernel code, masks and loops included; one test also compiles the
kernels for sm_90 (no GPU needed) to catch what the interpreter lets through. Shapes are kept
small because the interpreter is slow.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import nag_kernels
from nag_kernels import BACKENDS, nag_write, nag_write_reference, tangent_cutoff

REPO = Path(__file__).resolve().parents[1]
HAS_TRITON = nag_kernels._triton_ops is not None
if HAS_TRITON:
    from nag_kernels.nag_write import MAX_FUSED_SIZE, interpreter_active

    KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and not interpreter_active() else "cpu"
    KERNEL_RUNS = KERNEL_DEVICE == "cuda" or interpreter_active()
else:
    KERNEL_DEVICE, KERNEL_RUNS = "cpu", False
needs_kernel = pytest.mark.skipif(not KERNEL_RUNS, reason="needs triton with CUDA or TRITON_INTERPRET=1")

THETA_MAX = math.pi / 2
# Both paths compute in fp32 from the same rounded inputs; they differ by fp32 reduction order
# and then by at most an output ulp or so in the storage dtype.
TOLS = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}
DTYPES = list(TOLS)


def make_inputs(lead, d, dtype, *, gamma=True, gate=True, alpha=0.9, seed=0, f_scale=None):
    """Unit u, f with a per-row scale spanning 1e-3..30 (so theta covers the small-angle series,
    the exp branch of tanh and saturation), rho, g in [0, 1], scalar alpha/beta, gamma near 1."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(*lead, d, generator=gen, dtype=torch.float64)
    u = (u / torch.linalg.vector_norm(u, dim=-1, keepdim=True)).to(dtype)
    rows = math.prod(lead)
    if f_scale is None:
        f_scale = torch.logspace(-3, 1.5, rows, dtype=torch.float64).view(*lead, 1)
    f = (torch.randn(*lead, d, generator=gen, dtype=torch.float64) * f_scale).to(dtype)
    low = dtype if dtype != torch.float32 else torch.float32
    rho = torch.randn(*lead, generator=gen).to(low)
    g = torch.rand(*lead, generator=gen).to(low) if gate else None
    gm = (0.5 + torch.rand(d, generator=gen)) if gamma else None
    return dict(
        u=u, f=f, rho=rho, g=g,
        alpha=torch.tensor(alpha), beta=torch.tensor(0.3),
        theta_max=THETA_MAX, gamma_next=gm,
    )  # fmt: skip


def leaves(inputs, device):
    """Fresh leaf copies on `device`, requiring grad where the argument is differentiable."""
    out = {}
    for k, v in inputs.items():
        if isinstance(v, torch.Tensor):
            v = v.detach().to(device).clone().requires_grad_(True)
        out[k] = v
    return out


def loss_of(outs, weights):
    return sum((o.float() * w.to(o.device)).sum() for o, w in zip(outs, weights) if o is not None)


def run(inputs, backend, device, weights, use=(0, 1, 2, 3)):
    """Forward with `backend`, backward of a weighted sum of the outputs listed in `use`."""
    x = leaves(inputs, device)
    outs = nag_write(**x, backend=backend)
    used = [o if i in use else None for i, o in enumerate(outs)]
    loss_of(used, weights).backward()
    grads = {k: v.grad for k, v in x.items() if isinstance(v, torch.Tensor)}
    return [None if o is None else o.detach().cpu() for o in outs], grads


def random_weights(inputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    u, rho = inputs["u"], inputs["rho"]
    return [torch.randn(u.shape, generator=gen), torch.randn(rho.shape, generator=gen),
            torch.randn(rho.shape, generator=gen), torch.randn(u.shape, generator=gen)]  # fmt: skip


def assert_match(got, want, dtype, what):
    tol = TOLS.get(dtype, TOLS[torch.float32])
    assert got is not None and want is not None, what
    torch.testing.assert_close(got.cpu().float(), want.cpu().float(), **tol, msg=lambda m: f"{what}: {m}")


def compare_to_reference(inputs, dtype, use=(0, 1, 2, 3), grad_floor=1.0):
    w = random_weights(inputs)
    outs_k, grads_k = run(inputs, "triton", KERNEL_DEVICE, w, use)
    outs_r, grads_r = run(inputs, "torch", "cpu", w, use)
    for name, ok, orf in zip(("u_new", "rho_new", "theta", "h_next"), outs_k, outs_r):
        assert (ok is None) == (orf is None), name
        if ok is not None:
            assert ok.dtype == orf.dtype, name
            assert_match(ok, orf, dtype, name)
    for name, gr in grads_r.items():
        gk = grads_k[name]
        if gr is None:  # e.g. rho's gradient when rho_new is unused
            assert gk is None or not gk.any(), name
            continue
        assert gk.dtype == gr.dtype and gk.shape == gr.shape, name
        # Gradients are sums over d (and over rows for alpha, beta, gamma): atol scales with
        # each gradient's size, floored at grad_floor (lower it to check tiny gradients).
        scale = max(grad_floor, gr.abs().max().item())
        tol = TOLS[dtype]
        torch.testing.assert_close(
            gk.cpu().float(), gr.float(), atol=tol["atol"] * scale, rtol=tol["rtol"],
            msg=lambda m, name=name: f"grad {name}: {m}",
        )  # fmt: skip
    return outs_k, grads_k


# (lead shape, d, gamma_next given, g given, alpha)
SHAPES = [
    ((5, 29), 123, True, True, 0.9),
    ((7,), 1, False, False, 0.9),
    ((2, 3), 3, True, False, -0.6),
    ((4,), 127, False, True, 1.3),
    ((3,), 1000, True, True, 0.5),
]


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("lead,d,gamma,gate,alpha", SHAPES, ids=lambda v: str(v))
def test_kernel_matches_reference(lead, d, gamma, gate, alpha, dtype):
    if d == 123 and dtype != torch.float32:
        lead = (2, 7)  # the 145-row case once is enough for the slow interpreter
    inputs = make_inputs(lead, d, dtype, gamma=gamma, gate=gate, alpha=alpha)
    outs, grads = compare_to_reference(inputs, dtype)
    # Non-degenerate check: the rows really rotate, and every gradient is exercised.
    assert outs[2].float().abs().max() > 0.1 or d == 1
    for name in (
        ("u", "f", "rho", "alpha", "beta") + (("g",) if gate else ()) + (("gamma_next",) if gamma else ())
    ):
        if d > 1 or name not in ("alpha",):
            assert grads[name].abs().max() > 0, name


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("lead,d,gamma,gate,alpha", [SHAPES[0], SHAPES[2]], ids=lambda v: str(v))
def test_kernel_matches_reference_with_rational_bound(lead, d, gamma, gate, alpha, dtype):
    inputs = make_inputs(lead if dtype == torch.float32 else (2, 3), d, dtype, gamma=gamma, gate=gate,
                         alpha=alpha)
    outs, grads = compare_to_reference({**inputs, "bound": "rational"}, dtype)
    tanh_theta = nag_write_reference(**inputs)[2]
    assert not torch.allclose(outs[2].float(), tanh_theta.float())  # the bound really changed
    assert grads["alpha"].abs() > 0 and grads["f"].abs().max() > 0


@needs_kernel
@pytest.mark.parametrize("use", [(0,), (1,), (2,), (3,), (0, 2)], ids=["u", "rho", "theta", "h", "u+theta"])
def test_kernel_gradients_with_unused_outputs(use):
    """Outputs that do not reach the loss get no gradient tensor; the kernel skips them."""
    compare_to_reference(make_inputs((6,), 33, torch.float32), torch.float32, use=use)


@needs_kernel
def test_kernel_noncontiguous_and_broadcast_gate():
    base = make_inputs((4, 5), 17, torch.float32)
    x = dict(base)
    x["u"] = base["u"].transpose(0, 1).contiguous().transpose(0, 1)  # same values, strided
    x["f"] = base["f"].transpose(0, 1).contiguous().transpose(0, 1)
    x["rho"] = torch.stack([base["rho"], base["rho"]], -1)[..., 0]  # stride 2
    x["g"] = torch.rand(4, 1)  # broadcast over the second dim
    assert not x["u"].is_contiguous() and not x["f"].is_contiguous() and not x["rho"].is_contiguous()
    _, grads = compare_to_reference(x, torch.float32)
    assert grads["g"].shape == (4, 1)


@needs_kernel
def test_kernel_non_unit_u():
    """||u'|| = ||u|| for any ||u|| (a zero row stays zero): catches a missing renormalisation,
    which unit-norm inputs would hide since then ||raw|| = 1 up to rounding."""
    inputs = make_inputs((5,), 40, torch.float32)
    inputs["u"] = inputs["u"] * torch.tensor([0.5, 1.0, 2.0, 3.0, 0.0])[:, None]
    outs, _ = compare_to_reference(inputs, torch.float32)
    torch.testing.assert_close(outs[0].norm(dim=-1), inputs["u"].norm(dim=-1))


@needs_kernel
@pytest.mark.parametrize("n", [1e-7, 1e-4, 1e-2], ids=["tiny", "small", "moderate"])
def test_kernel_small_tangent(n):
    """f = n * (unit vector orthogonal to u): however small, not parallel to u, so it turns
    (the cutoff is relative to |f|). theta ~ g alpha n / sqrt(d) is
    tiny, so compare it with a relative tolerance; alpha's and g's gradients are O(n) here, so
    the gradient tolerance floor goes down to n / 100 (beta's gradient, O(<f, u>), is rounding
    noise here and stays below it)."""
    inputs = make_inputs((6,), 24, torch.float32)
    u = inputs["u"].double()
    perp = torch.randn(6, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    perp -= (perp * u).sum(-1, keepdim=True) * u
    inputs["f"] = (n * perp / torch.linalg.vector_norm(perp, dim=-1, keepdim=True)).float()
    outs, _ = compare_to_reference(inputs, torch.float32, grad_floor=n / 100)
    want = THETA_MAX * torch.tanh(inputs["g"].double() * 0.9 * n / math.sqrt(24) / THETA_MAX)
    torch.testing.assert_close(outs[2].double(), want, rtol=1e-5, atol=0)


@needs_kernel
def test_kernel_mixed_dtypes():
    """Autocast-style call: fp32 state u, rho and gate, bf16 sublayer output f. Outputs follow u
    and rho; df comes back in bf16."""
    inputs = make_inputs((3, 5), 48, torch.float32)
    inputs["f"] = inputs["f"].to(torch.bfloat16)
    _, grads = compare_to_reference(inputs, torch.bfloat16)
    assert grads["f"].dtype == torch.bfloat16 and grads["u"].dtype == torch.float32


def kernel_and_reference(inputs):
    """Outputs of both backends (no autograd), for the invariant tests."""
    with torch.no_grad():
        ref = nag_write(**inputs, backend="torch")
        if not KERNEL_RUNS:
            return [ref]
        x = {k: v.to(KERNEL_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        ker = [None if o is None else o.cpu() for o in nag_write(**x, backend="triton")]
    return [ref, ker]


def unit_norm_error(u_new):
    return (torch.linalg.vector_norm(u_new.double(), dim=-1) - 1).abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_zero_gate_is_exact_identity(dtype):
    inputs = make_inputs((3, 4), 37, dtype)
    inputs["g"] = torch.zeros_like(inputs["g"])
    h_want = (math.sqrt(37) * inputs["u"].float() * inputs["gamma_next"]).to(dtype)
    for u_new, rho_new, theta, h in kernel_and_reference(inputs):
        assert torch.equal(u_new, inputs["u"])
        assert torch.equal(rho_new, inputs["rho"])
        assert not theta.any()
        torch.testing.assert_close(h, h_want, **TOLS[dtype])


@pytest.mark.parametrize("bound", nag_kernels.BOUNDS)
@pytest.mark.parametrize("kind", ["zero", "parallel", "huge", "overflowing", "generic"])
def test_invariants(kind, bound):
    """||u'|| = 1, acos(<u, u'>) = |theta|, |theta| <= theta_max, theta independent of rho, for
    any f: "overflowing" has elements up to 1e30, so ||f_perp||^2 is far past fp32's range."""
    d = 64
    inputs = {**make_inputs((5,), d, torch.float32), "bound": bound}
    u = inputs["u"]
    if kind == "zero":
        inputs["f"] = torch.zeros_like(u)
    elif kind == "parallel":
        inputs["f"] = 3.0 * u
    elif kind == "huge":
        inputs["f"] = 1e4 * torch.randn(5, d)
    elif kind == "overflowing":
        gen = torch.Generator().manual_seed(2)
        inputs["f"] = torch.logspace(19, 30, 5)[:, None] * torch.randn(5, d, generator=gen)
    other_rho = dict(inputs, rho=inputs["rho"] + 5.0)
    results = kernel_and_reference(inputs)
    for (u_new, rho_new, theta, _), (_, _, theta2, _) in zip(results, kernel_and_reference(other_rho)):
        assert torch.isfinite(u_new).all() and torch.isfinite(theta).all()
        assert unit_norm_error(u_new) < 1e-6
        # tanh rounds to 1 in fp32 for large arguments, so theta can reach theta_max exactly.
        assert (theta.abs() <= THETA_MAX).all()
        cos_angle = (u_new.double() * u.double()).sum(-1).clamp(-1, 1)
        torch.testing.assert_close(torch.acos(cos_angle).float(), theta.abs(), atol=1e-3, rtol=0)
        assert torch.equal(theta, theta2)
        a = (inputs["f"].double() * u.double()).sum(-1)
        expect_rho = inputs["rho"].double() + inputs["g"].double() * 0.3 * a / math.sqrt(d)
        torch.testing.assert_close(rho_new.double(), expect_rho, atol=1e-3, rtol=1e-5)
        if kind in ("zero", "parallel"):
            assert theta.abs().max() < 1e-5
            torch.testing.assert_close(u_new, u, atol=1e-6, rtol=0)
        if kind in ("huge", "overflowing"):
            assert theta.min() > 0.99 * THETA_MAX  # alpha > 0 and g > 0 on every row here


def overflowing_inputs(bound, alpha=0.9):
    """f with elements up to 1e30, so ||f_perp||^2 (up to ~1e62) is far past fp32's ~3e38."""
    inputs = {**make_inputs((6,), 64, torch.float32, alpha=alpha), "bound": bound}
    gen = torch.Generator().manual_seed(4)
    inputs["f"] = torch.logspace(19, 30, 6)[:, None] * torch.randn(6, 64, generator=gen)
    return inputs


@pytest.mark.parametrize("bound", nag_kernels.BOUNDS)
def test_zero_gate_is_exact_identity_for_overflowing_f(bound):
    inputs = overflowing_inputs(bound)
    inputs["g"] = torch.zeros_like(inputs["g"])
    for u_new, rho_new, theta, _ in kernel_and_reference(inputs):
        assert torch.equal(u_new, inputs["u"]) and torch.equal(rho_new, inputs["rho"])
        assert not theta.any()


@pytest.mark.parametrize("bound", nag_kernels.BOUNDS)
def test_overflowing_f_turns_by_theta_below_saturation(bound):
    """alpha = 1e-30 against |f| ~ 1e29..1e30: theta = bound(g alpha n / sqrt(d)) is a moderate
    angle that needs n itself, which the unscaled ||f_perp||^2 loses to overflow."""
    inputs = overflowing_inputs(bound, alpha=1e-30)
    inputs["f"] = inputs["f"] / inputs["f"].abs().amax(-1, keepdim=True) * torch.logspace(29, 30, 6)[:, None]
    u, f = inputs["u"].double(), inputs["f"].double()
    n = torch.linalg.vector_norm(f - (f * u).sum(-1, keepdim=True) * u, dim=-1)
    x = inputs["g"].double() * 1e-30 * n / 8
    want = THETA_MAX * (torch.tanh(x / THETA_MAX) if bound == "tanh" else x / (THETA_MAX + x))
    assert 0.05 < want.max() < 0.9 * THETA_MAX  # not saturated
    for u_new, _, theta, _ in kernel_and_reference(inputs):
        torch.testing.assert_close(theta.double(), want, rtol=1e-5, atol=1e-7)
        assert unit_norm_error(u_new) < 1e-6
        cos_angle = (u_new.double() * u).sum(-1).clamp(-1, 1)
        torch.testing.assert_close(torch.acos(cos_angle), want, atol=1e-3, rtol=0)


@pytest.mark.parametrize("alpha", [0.9, 1e-30], ids=["saturated", "moderate"])
@pytest.mark.parametrize("bound", nag_kernels.BOUNDS)
def test_gradients_are_finite_for_overflowing_f(bound, alpha):
    inputs = overflowing_inputs(bound, alpha)
    if KERNEL_RUNS:  # the kernel's hand-written backward against the reference's autograd
        _, grads = compare_to_reference(inputs, torch.float32, grad_floor=1e-6)
    else:
        _, grads = run(inputs, "torch", "cpu", random_weights(inputs))
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)
    assert grads["u"].abs().max() > 0 and grads["f"].abs().max() > 0


@needs_kernel
@pytest.mark.parametrize("kind", ["zero", "parallel", "huge"])
def test_kernel_gradients_at_edge_cases(kind):
    inputs = make_inputs((4,), 16, torch.float32)
    if kind == "zero":
        inputs["f"] = torch.zeros_like(inputs["u"])
    elif kind == "parallel":
        inputs["f"] = -2.0 * inputs["u"]
    else:
        inputs["f"] = 1e4 * torch.randn(4, 16)
    # theta = g alpha ||f_perp|| / sqrt(d) has a kink (like |x|) where f is parallel to u: its
    # gradient there points along rounding noise, which differs between the two paths. u', rho'
    # and h are smooth there, so leave theta out of the loss in that case only.
    use = (0, 1, 3) if kind == "parallel" else (0, 1, 2, 3)
    _, grads = compare_to_reference(inputs, torch.float32, use=use)
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_small_tangent_uses_the_limit():
    """Where f is too small to turn (here zero), sin(theta) / n is replaced by its limit
    g alpha / sqrt(d): u' = u, theta = 0, and du'/df is the limit's k (I - u u^T), so a sublayer
    whose output starts at zero still learns to turn."""
    inputs = make_inputs((1,), 8, torch.float64)
    u = inputs["u"]
    k = (inputs["g"] * inputs["alpha"] / math.sqrt(8)).item()

    def turned(f):
        return nag_write_reference(**{**inputs, "f": f})[0]

    zero = torch.zeros_like(u)
    u_new, _, theta, _ = nag_write_reference(**{**inputs, "f": zero})
    assert torch.equal(u_new, u) and torch.equal(theta, torch.zeros_like(theta))
    jacobian = torch.autograd.functional.jacobian(turned, zero)[0, :, 0, :]
    want = k * (torch.eye(8, dtype=torch.float64) - u[0, :, None] * u[0, None, :])
    torch.testing.assert_close(jacobian, want, atol=1e-12, rtol=0)


def gradcheck_inputs(f_kind):
    x = make_inputs((2, 3), 5, torch.float64)
    x["alpha"], x["beta"] = x["alpha"].double(), x["beta"].double()
    x["gamma_next"] = x["gamma_next"].double()
    x["g"] = x["g"].double()
    u = x["u"]
    if f_kind != "generic":
        # a fixed direction: drawn from the global generator, it changed with the tests run before
        perp = torch.randn(2, 3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        perp -= (perp * u).sum(-1, keepdim=True) * u
        perp /= torch.linalg.vector_norm(perp, dim=-1, keepdim=True)
        n = 1e-4 if f_kind == "small_n" else 1e-8  # small, but far above the cutoff (~1e-15)
        x["f"] = 2.0 * u + n * perp
    return x


@pytest.mark.parametrize("path", ["reference", "op"])
@pytest.mark.parametrize("bound", nag_kernels.BOUNDS)
@pytest.mark.parametrize("f_kind", ["generic", "small_n", "tiny_n"])
def test_reference_gradcheck(f_kind, bound, path):
    """Autograd through the reference, and the operator's written-out backward (backend="torch")."""
    x = gradcheck_inputs(f_kind)
    names = ["u", "f", "rho", "g", "alpha", "beta", "gamma_next"]
    args = tuple(x[k].clone().requires_grad_(True) for k in names)

    def fn(u, f, rho, g, alpha, beta, gamma_next):
        if path == "op":
            return nag_write(u, f, rho, g, alpha, beta, THETA_MAX, gamma_next, backend="torch", bound=bound)
        return nag_write_reference(u, f, rho, g, alpha, beta, THETA_MAX, gamma_next, bound)

    # The direction f_perp / n turns by O(step / n) per step of f: step well under n.
    eps = 1e-10 if f_kind == "tiny_n" else 1e-6
    atol = 1e-4 if f_kind == "tiny_n" else 1e-5
    assert torch.autograd.gradcheck(fn, args, eps=eps, atol=atol)
    n = torch.linalg.vector_norm(x["f"] - (x["f"] * x["u"]).sum(-1, keepdim=True) * x["u"], dim=-1)
    assert (n > 100 * tangent_cutoff(torch.float64) * x["f"].norm(dim=-1)).all()


@pytest.mark.parametrize("path", ["reference", "op"])
@pytest.mark.parametrize("f_kind", ["generic", "small_n"])  # at tiny_n the turn is ill-conditioned
def test_given_angle_gradcheck(f_kind, path):
    """The gated NAG's write: theta is an input, and its gradient flows back to it."""
    x = gradcheck_inputs(f_kind)
    x["angle"] = torch.rand(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    names = ["u", "f", "rho", "g", "alpha", "beta", "gamma_next", "angle"]
    args = tuple(x[k].clone().requires_grad_(True) for k in names)

    def fn(u, f, rho, g, alpha, beta, gamma_next, angle):
        if path == "op":
            return nag_write(u, f, rho, g, alpha, beta, THETA_MAX, gamma_next, backend="torch", angle=angle)
        return nag_write_reference(u, f, rho, g, alpha, beta, THETA_MAX, gamma_next, angle=angle)

    # The direction f_perp / n turns by O(step / n) per step of f: near n = 1e-4 the steps must
    # be far below n for differences to be linear.
    eps = {"generic": 1e-6, "small_n": 1e-10}[f_kind]
    atol = 1e-5 if f_kind == "generic" else 1e-4
    assert torch.autograd.gradcheck(fn, args, eps=eps, atol=atol)


def turn_of(u, u_new):
    """acos(<u, u'>) of the directions (u stored in bf16 or fp16 is unit-norm only to 1e-3)."""
    u, u_new = (torch.nn.functional.normalize(x.double(), dim=-1) for x in (u, u_new))
    return torch.acos(torch.linalg.vecdot(u_new, u).clamp(-1, 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
@pytest.mark.parametrize("given", [True, False], ids=["given_angle", "magnitude_angle"])
def test_f_parallel_to_u_turns_by_no_more_than_its_rounding(given, dtype):
    """The cutoff is relative to |f|: f = s u (s from 1e-7 to 1e4) has a tangential part of a few
    ulps of |f|, rounding noise. A given angle does not turn u toward it (exact maths: no turn)
    and reports 0, the turn applied; the magnitude angle turns by its own measure of that noise,
    g alpha n / sqrt(d), which stays within the rounding of |f|."""
    scales = torch.tensor([1e-7, 1e-3, 1.0, 1e3, 1e4, -1e3]).view(6, 1)
    if dtype == torch.float16:
        scales[0] = 1e-3  # 1e-7 is below fp16's range
    inputs = make_inputs((6,), 64, dtype)
    inputs["f"] = (inputs["u"].double() * scales).to(dtype)
    if given:
        inputs["angle"] = torch.full((6,), 0.4).to(inputs["rho"].dtype)
    noise = 0.9 / 8 * tangent_cutoff(dtype) * inputs["f"].double().norm(dim=-1)  # alpha / sqrt(d)
    measured = {torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 1e-2}[dtype]  # u' stored
    for u_new, _, theta, _ in kernel_and_reference(inputs):
        turn = turn_of(inputs["u"], u_new)
        if given:
            assert torch.equal(theta, torch.zeros_like(theta))
            assert turn.max() < measured
        else:
            assert (theta.double().abs() <= noise).all()
            assert (turn <= noise + measured).all()


def test_a_tiny_f_that_is_not_parallel_turns_by_the_angle_it_reports():
    """f of norm 1e-7 in a direction of its own: the cutoff is relative, so the given angle turns
    u, and acos(<u, u'>) is the theta reported."""
    inputs = make_inputs((5,), 64, torch.float32, f_scale=1e-7 / 8)
    inputs["angle"] = torch.full((5,), 0.4)
    for u_new, _, theta, _ in kernel_and_reference(inputs):
        assert torch.equal(theta, inputs["angle"])
        torch.testing.assert_close(turn_of(inputs["u"], u_new), theta.double(), atol=1e-4, rtol=0)


@needs_kernel
@pytest.mark.parametrize("kind", ["parallel", "tiny"])
def test_kernel_gradients_match_with_a_given_angle_at_the_cutoff(kind):
    """The kernel and the reference agree on which rows are too small to turn, and so on every
    gradient, the angle's included (0 where a row does not turn)."""
    inputs = make_inputs((6,), 24, torch.float32, f_scale=1e-7 if kind == "tiny" else None)
    if kind == "parallel":
        inputs["f"][::2] = 1e3 * inputs["u"][::2]
    inputs["angle"] = torch.linspace(0.1, 0.6, 6)
    _, grads = compare_to_reference(inputs, torch.float32, use=(0, 1, 2, 3))
    if kind == "parallel":
        assert torch.equal(grads["angle"][::2], torch.zeros(3))
    assert grads["angle"][1::2].abs().min() > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).split(".")[-1])
def test_given_angle_is_the_turn(dtype):
    """theta = angle whatever f's size; acos(<u, u'>) = angle; no turn, and theta 0, where f has
    no tangential part; angle 0 is an exact identity of u (rho still moves by g beta a / sqrt(d))."""
    inputs = make_inputs((4, 6), 32, dtype)
    angle = torch.linspace(0.1, 1.2, 24).view(4, 6).to(inputs["rho"].dtype)
    inputs["f"][0, 0] = 2 * inputs["u"][0, 0]  # parallel: nothing to turn toward
    a = torch.linalg.vecdot(inputs["f"].float(), inputs["u"].float())
    rho_want = inputs["rho"].float() + inputs["g"].float() * 0.3 * a / math.sqrt(32)
    want = angle.clone()
    want[0, 0] = 0.0
    for u_new, rho_new, theta, _ in kernel_and_reference({**inputs, "angle": angle}):
        assert torch.equal(theta, want)
        torch.testing.assert_close(rho_new.float(), rho_want, **TOLS[dtype])
        cos = torch.linalg.vecdot(u_new.double(), inputs["u"].double()).clamp(-1, 1)
        tol = {torch.float32: 1e-3, torch.bfloat16: 6e-2, torch.float16: 1e-2}[dtype]
        torch.testing.assert_close(torch.acos(cos), want.double(), atol=tol, rtol=0)
        assert unit_norm_error(u_new) < tol
    zero = {**inputs, "angle": torch.zeros_like(angle)}
    for u_new, *_ in kernel_and_reference(zero):
        assert torch.equal(u_new, inputs["u"])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("lead,d,gamma,gate,alpha", [SHAPES[0], SHAPES[1], SHAPES[4]], ids=lambda v: str(v))
def test_kernel_matches_reference_with_given_angle(lead, d, gamma, gate, alpha, dtype):
    if d == 123 and dtype != torch.float32:
        lead = (2, 7)
    inputs = make_inputs(lead, d, dtype, gamma=gamma, gate=gate, alpha=alpha)
    inputs["angle"] = torch.rand(lead, generator=torch.Generator().manual_seed(7)) * 0.8
    outs, grads = compare_to_reference(inputs, dtype)
    # theta in rho's dtype; at d = 1 every f is parallel to u: no direction to turn toward
    want = inputs["angle"] * (d > 1)
    torch.testing.assert_close(outs[2], want.to(outs[2].dtype))
    assert (grads["angle"].abs().max() > 0) == (d > 1) and not grads["alpha"].any()


def test_backend_names():
    x = make_inputs((2,), 4, torch.float32)
    with pytest.raises(ValueError, match="valid choices: auto, triton, inductor, torch"):
        nag_write(**x, backend="cuda")
    assert BACKENDS == ("auto", "triton", "inductor", "torch")


def test_auto_uses_reference_on_cpu(monkeypatch):
    calls = []

    def spy(*args, **kwargs):
        calls.append(1)
        return nag_write_reference(*args, **kwargs)

    monkeypatch.setattr(sys.modules["nag_kernels.ops"], "nag_write_reference", spy)
    nag_write(**make_inputs((2,), 4, torch.float32), backend="auto")
    assert calls == [1]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_backend_errors(monkeypatch):
    x = make_inputs((2,), 4, torch.float32)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        nag_write(**make_inputs((2,), 4, torch.float64), backend="triton")
    with pytest.raises(ValueError, match=f"d <= {MAX_FUSED_SIZE}"):
        nag_write(**make_inputs((1,), MAX_FUSED_SIZE + 1, torch.float32), backend="triton")
    monkeypatch.setattr(sys.modules["nag_kernels.nag_write"], "interpreter_active", lambda: False)
    with pytest.raises(RuntimeError, match="needs CUDA tensors, or TRITON_INTERPRET=1"):
        nag_write(**x, backend="triton")


def test_shape_errors():
    x = make_inputs((2, 3), 4, torch.float32)
    with pytest.raises(ValueError, match="rho must have shape"):
        nag_write(**dict(x, rho=x["rho"][0]))
    with pytest.raises(ValueError, match="gamma_next must have shape"):
        nag_write(**dict(x, gamma_next=torch.ones(5)))
    with pytest.raises(ValueError, match="theta_max must be positive"):
        nag_write(**dict(x, theta_max=0.0))
    with pytest.raises(ValueError, match="Unknown bound 'atan'; valid choices: tanh, rational"):
        nag_write(**x, bound="atan")


@needs_kernel
def test_public_function_not_shadowed_by_submodule():
    """Importing the submodule nag_kernels.nag_write must not replace the function of that name."""
    import nag_kernels.nag_write  # noqa: F401

    nag_write(**make_inputs((2,), 4, torch.float32), backend="triton")
    assert nag_kernels.nag_write is nag_write and callable(nag_kernels.nag_write)


COMPILE_SCRIPT = textwrap.dedent(
    """
    import sys, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import nag_kernels
    m = sys.modules["nag_kernels.nag_write"]
    INTS = {"n_rows", "n_cols", "rows_per_program"}
    DATA = {"U", "F", "U_OUT", "H_OUT", "GU_NEW", "GH", "DU", "DF"}  # pointers in the input dtype
    # (dtype, d, every flag but GIVEN, GIVEN): GIVEN=True leaves the bound's code out
    CASES = [("fp32", 1, True, False), ("bf16", 4096, True, True), ("fp16", 100, False, False),
             ("bf16", 16384, True, False), ("fp16", 64, False, True)]

    def compile(kernel, dtype, d, flags, given, warps):
        sig, consts = {}, {}
        for i, name in enumerate(kernel.arg_names):
            if kernel.params[i].is_constexpr:
                sig[name] = "constexpr"
                consts[name] = {"BLOCK_SIZE": triton.next_power_of_2(d), "GIVEN": given}.get(name, flags)
            elif name in INTS:
                sig[name] = "i32"
            elif name.islower():
                sig[name] = "fp32"
            else:
                sig[name] = "*" + (dtype if name in DATA else "fp32")
        src = ASTSource(kernel, sig, consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))

    for dtype, d, flags, given in CASES:
        _, fw, bw = m.calculate_settings(d)
        for kernel, warps in ((m._nag_write_fwd_kernel, fw), (m._nag_write_bwd_kernel, bw)):
            ptx = compile(kernel, dtype, d, flags, given, warps).asm["ptx"]
            assert ".entry" in ptx
    print("compiled")
    """
)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_kernels_compile_for_sm90():
    """Real code generation (no GPU needed): the interpreter accepts things the compiler rejects."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("triton has no NVIDIA backend here")
    env = dict(os.environ, TRITON_INTERPRET="0")
    r = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def test_wheel_installs_kernels_as_nag_kernels(tmp_path):
    """pyproject maps the folder kernels/ to the package nag_kernels; no top-level `kernels`. The
    recipes/ folder installs as nag_lightning/recipes, where the studies find their recipes."""
    src = tmp_path / "src"  # build from a copy so the checkout gets no build/ or egg-info
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, src / name)
    for name in ("kernels", "nag_lightning", "recipes"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(tmp_path / "dist"),
        str(src),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0 and ("No module named 'setuptools'" in r.stderr or "BackendUnavailable" in r.stderr):
        pytest.skip("the setuptools build backend is not installed")
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "nag_kernels/__init__.py" in names and "nag_kernels/nag_write.py" in names
    assert "nag_kernels/reference.py" in names
    assert not any(n.startswith("kernels/") for n in names)
    recipes = {str(path.relative_to(REPO)) for path in (REPO / "recipes").rglob("*.yaml")}
    assert {f"nag_lightning/{name}" for name in recipes} <= set(names) and recipes
    sources = {path.relative_to(REPO).as_posix() for path in (REPO / "nag_lightning").rglob("*.py")}
    assert sources - set(names) == set()  # every subpackage is listed in pyproject's packages


@pytest.mark.parametrize("f_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_gamma", [False, True])
def test_torch_backend_recomputes_the_reference_exactly(f_dtype, with_gamma):
    """backend="torch" keeps only the inputs for backward; values and gradients are unchanged."""
    torch.manual_seed(0)
    u = torch.nn.functional.normalize(torch.randn(7, 33), dim=-1)
    f = (3 * torch.randn(7, 33)).to(f_dtype)
    f[0] = 0  # the small-n branch
    leaves = {
        "u": u, "f": f, "rho": torch.randn(7), "g": torch.rand(7), "alpha": torch.tensor(0.7),
        "beta": torch.tensor(0.3), "gamma": torch.rand(33) + 0.5 if with_gamma else None,
    }

    def run(fn):
        inputs = {k: None if v is None else v.clone().requires_grad_() for k, v in leaves.items()}
        outs = fn(inputs["u"], inputs["f"], inputs["rho"], inputs["g"], inputs["alpha"],
                  inputs["beta"], math.pi / 2, inputs["gamma"])
        loss = sum((o.float() * torch.linspace(-1, 1, o.numel()).view_as(o)).sum()
                   for o in outs if o is not None)
        loss.backward()
        return outs, {k: v.grad for k, v in inputs.items() if v is not None}

    expected, expected_grads = run(nag_write_reference)
    got, got_grads = run(lambda *a: nag_write(*a, backend="torch"))
    for e, g in zip(expected, got, strict=True):
        assert (e is None and g is None) or torch.equal(e, g)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_torch_backend_saves_only_its_inputs():
    u = torch.nn.functional.normalize(torch.randn(64, 128), dim=-1).requires_grad_()
    f = torch.randn(64, 128, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        nag_write(u, f, torch.zeros(64), None, torch.tensor(0.5), torch.tensor(0.0), 1.5, backend="torch")
    big = [t for t in saved if t.numel() >= 64 * 128]
    assert len(big) == 2  # u and f, not the reference's intermediates


def test_training_with_the_kernel_follows_the_reference():
    """A few optimizer steps of a tiny NAG model: the Triton path (interpreted on CPU) and the
    PyTorch path give the same loss curve."""
    from nag_lightning import Transformer, TransformerConfig

    def losses(kernel: str) -> list[float]:
        torch.manual_seed(0)
        cfg = TransformerConfig(d_model=16, n_layers=2, n_heads=2, seq_len=8, residual="nag",
                                residual_options={"kernel": kernel, "beta_init": 0.1,
                                                  "norm_lane_readout": True})
        model = Transformer(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batch = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
        curve = []
        for _ in range(4):
            logits = model(batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            curve.append(loss.item())
        return curve

    reference, kernel = losses("torch"), losses("triton")
    assert reference[-1] < reference[0]  # it trains
    torch.testing.assert_close(torch.tensor(kernel), torch.tensor(reference), atol=1e-4, rtol=0)
