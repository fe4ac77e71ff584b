"""The NAG write compiled by inductor for eager CPU training (`nag_kernels/compiled.py`): the same
values and gradients as the reference, chosen by `auto` only where it pays, and the reference
again, with one warning, where compiling fails."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from nag_kernels import gated_nag_write, nag_write
from tests.test_kernels import leaves, loss_of, make_inputs

compiled = sys.modules["nag_kernels.compiled"]


def values_and_grads(inputs, backend, **options):
    x = leaves(inputs, "cpu")
    outs = nag_write(**x, backend=backend, **options)
    weights = [torch.linspace(-1, 1, o.numel()).view(o.shape) for o in outs if o is not None]
    tensors = [v for v in x.values() if isinstance(v, torch.Tensor)]
    grads = torch.autograd.grad(loss_of([o for o in outs if o is not None], weights), tensors)
    return [o for o in outs if o is not None], grads


@pytest.mark.parametrize("case", ["gated, next read, tanh", "given angle, rational"])
def test_compiled_write_matches_reference(case):
    """Forward and every gradient within fp32 rounding of the reference's, for the two ways the
    model calls the write (a few seconds of compilation each with inductor's cache warm)."""
    if case.startswith("gated"):
        inputs, options = make_inputs((4, 33), 64, torch.float32), {"bound": "tanh"}
    else:
        inputs = make_inputs((4, 33), 64, torch.float32, gamma=False)
        angle = torch.rand(4, 33, generator=torch.Generator().manual_seed(1))
        options = {"bound": "rational", "angle": angle}
    want_outs, want_grads = values_and_grads(inputs, "torch", **options)
    got_outs, got_grads = values_and_grads(inputs, "inductor", **options)
    assert not compiled._failed
    for got, want in zip([*got_outs, *got_grads], [*want_outs, *want_grads]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_auto_compiles_only_large_eager_cpu_writes():
    big, small = torch.empty(compiled.MIN_ELEMENTS // 64, 64), torch.empty(4, 64)
    assert compiled.usable(big) and compiled.usable(big.bfloat16())
    assert not compiled.usable(small)  # a test or a short run does not pay for the compilation
    assert not compiled.usable(big.double())  # gradcheck keeps the reference


def test_compilation_failure_falls_back_to_reference_with_one_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **options: broken)  # fails on the first call
    monkeypatch.setattr(compiled, "_failed", False)
    inputs = make_inputs((3, 5), 16, torch.float32)
    want_outs, want_grads = values_and_grads(inputs, "torch")
    with pytest.warns(UserWarning, match="could not be compiled for CPU .*no C\\+\\+ compiler found"):
        got_outs, got_grads = values_and_grads(inputs, "inductor")
    for got, want in zip([*got_outs, *got_grads], [*want_outs, *want_grads]):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert compiled._failed and not compiled.usable(torch.empty(compiled.MIN_ELEMENTS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once is enough
        values_and_grads(inputs, "inductor")


@pytest.mark.parametrize("gated", [True, False], ids=["router gate", "no router"])
@pytest.mark.parametrize("radial", [True, False], ids=["radial gated", "radial by g"])
def test_gated_write_compiled_with_its_angle_matches_the_angle_given_to_the_reference(gated, radial):
    """The gated NAG's write with the angle's formulas compiled into it (eager CPU) has the values
    and gradients (u, f, rho, g, alpha, beta, the gate's weights and bias) of the angle computed
    in PyTorch and given to the reference write, with every output reaching the loss."""
    inputs = make_inputs((4, 33), 64, torch.float32, gamma=False, gate=gated)
    gen = torch.Generator().manual_seed(2)
    inputs |= {"gate_w": 0.1 * torch.randn(64, generator=gen), "gate_b": torch.tensor(0.3)}
    del inputs["gamma_next"]

    def values_and_grads(backend):
        x = leaves(inputs, "cpu")
        outs = gated_nag_write(**x, gain=8.0, radial=radial, backend=backend)
        weights = [torch.linspace(-1, 1, o.numel()).view(o.shape) for o in outs]
        tensors = [v for v in x.values() if isinstance(v, torch.Tensor)]
        return outs, torch.autograd.grad(loss_of(outs, weights), tensors)

    want_outs, want_grads = values_and_grads("torch")
    got_outs, got_grads = values_and_grads("inductor")
    assert not compiled._failed
    for got, want in zip([*got_outs, *got_grads], [*want_outs, *want_grads]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_gated_write_compiles_once_whatever_the_gate_gradients_and_sizes():
    """A process that trains several models (a benchmark, a sweep) calls the compiled write with
    and without a router's gate, with and without gradients, at several widths and bounds: one
    compilation of its forward and one of its backward serve them all. Dynamo compiles a function
    at most 8 times and then runs it uncompiled, which made a whole run's writes several times
    slower."""

    def write(d, theta_max, gated, grad):
        gen = torch.Generator().manual_seed(d)
        u = torch.nn.functional.normalize(torch.randn(6, d, generator=gen), dim=-1)
        tensors = [u, torch.randn(6, d, generator=gen), torch.zeros(6), torch.tensor(1.0),
                   torch.tensor(0.5), 0.1 * torch.randn(d, generator=gen), torch.tensor(0.0)]
        u, f, rho, alpha, beta, w, b = (t.requires_grad_(grad) for t in tensors)
        g = torch.rand(6, generator=gen) if gated else None
        with torch.set_grad_enabled(grad):
            outs = gated_nag_write(u, f, rho, g, alpha, beta, theta_max, w, b, d**0.5, backend="inductor")
            if grad:
                sum(o.sum() for o in outs).backward()

    write(16, 0.5, False, True)  # compiles the forward and the backward
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for d, theta_max, gated, grad in [(16, 0.5, True, True), (32, 1.5, False, True), (32, 1.5, True, False)]:
        write(d, theta_max, gated, grad)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == before
    assert not compiled._failed
