"""The NAG write compiled by inductor for eager CPU training (`nag_kernels/compiled.py`): the same
values and gradients as the reference, chosen by `auto` only where it pays, and the reference
again, with one warning, where compiling fails."""

from __future__ import annotations

import sys
import threading
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


def test_a_long_training_run_compiles_smaller_writes(monkeypatch):
    """A write under MIN_ELEMENTS compiles where the run under way is long enough to repay it: the
    hops recipes' 2048 rows of 64 over 3000 steps, not over 100, and not once the run ended."""
    monkeypatch.setattr(compiled, "_training_steps", None)
    hops = torch.empty(2048, 64)
    assert not compiled.usable(hops)
    compiled.expect_training_steps(3000)
    assert compiled.usable(hops) and compiled.usable(torch.empty(4, 64), pass_elements=2048 * 64)
    assert not compiled.usable(torch.empty(4, 64))  # a test's write, even in a long run
    compiled.expect_training_steps(100)
    assert not compiled.usable(hops)
    compiled.expect_training_steps(float("inf"))  # a run with no end known
    assert compiled.usable(hops)
    compiled.expect_training_steps(None)
    assert not compiled.usable(hops)
    with pytest.raises(ValueError, match="steps must be"):
        compiled.expect_training_steps(-1)


def test_fit_tells_the_write_how_long_it_trains(monkeypatch, tmp_path):
    """During a NAG model's fit the write knows the steps the run has left; afterwards nothing."""
    import lightning as L

    from tests.test_budget import loader, model, trainer

    monkeypatch.setattr(compiled, "_training_steps", None)
    seen = []

    class Look(L.Callback):
        def on_train_batch_start(self, *args):
            seen.append(compiled._training_steps)

    trainer(tmp_path, [Look()], max_steps=5).fit(model(), loader())
    assert seen == [5] * 5 and compiled._training_steps is None


@pytest.mark.parametrize("full_write_compiles", [True, False], ids=["large pass", "small pass"])
def test_a_routed_write_runs_as_its_passs_full_writes_do(monkeypatch, full_write_compiles):
    """`auto` chooses by the model's full write, so the routed MLPs' writes of a few of a pass's rows
    take the compiled path exactly where the unrouted attention writes of the same pass do."""
    from nag_lightning.model.transformer import Transformer, TransformerConfig

    batch, seq, d = 2, 16, 16
    monkeypatch.setattr(compiled, "MIN_ELEMENTS", batch * seq * d + (0 if full_write_compiles else 1))
    chosen = set()  # (rows written, whether the compiled path was chosen)
    usable = compiled.usable

    def spy(u, pass_elements=None):
        chosen.add((u.shape[:-1].numel(), usable(u, pass_elements)))
        return False  # the reference runs: nothing is compiled here

    monkeypatch.setattr(compiled, "usable", spy)
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(
        d_model=d, n_layers=2, n_heads=2, seq_len=seq, router="threshold", route_kinds=["mlp"],
        router_options={"predictor": "angle", "target_rate": 0.5, "warmup_steps": 0},
    ))  # fmt: skip
    with torch.no_grad():
        model.strategy.angle.gate_w.normal_()  # tokens' angles differ, so the router picks some
    tokens = torch.randint(0, 256, (batch, seq))
    for _ in range(2):  # the first pass sets the router's threshold, the second skips
        model(tokens)
    rows = {n for n, _ in chosen}
    assert min(rows) < batch * seq == max(rows)  # the routed MLPs wrote fewer rows
    assert {c for _, c in chosen} == {full_write_compiles}


def test_compilation_failure_falls_back_to_reference_with_one_warning(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(torch._inductor, "standalone_compile", broken)  # fails on the first call
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


def test_gated_write_compiles_once_per_setting_whatever_the_gate_gradients_and_sizes():
    """A process that trains several models (a benchmark, a sweep) calls the compiled write with
    and without a router's gate, with and without gradients, at several batch shapes and for
    several layers (each its own row of the parameters) with each layer's own bound (the decaying
    schedule): one compiled forward and one compiled backward serve them all."""

    def write(d, theta_max, gated, grad, rows=(6,), layer=0):
        gen = torch.Generator().manual_seed(d)
        u = torch.nn.functional.normalize(torch.randn(*rows, d, generator=gen), dim=-1)
        tensors = [u, torch.randn(*rows, d, generator=gen), torch.zeros(rows), torch.tensor(1.0),
                   torch.tensor(0.5), 0.1 * torch.randn(d, generator=gen), torch.tensor(0.0)]
        u, f, rho, alpha, beta, w, b = (t.requires_grad_(grad) for t in tensors)
        if layer:  # a layer's row of the model's parameters, as NAG's writes get them
            alpha, w = torch.stack((alpha,) * 3)[layer], torch.stack((w,) * 3)[layer]
        g = torch.rand(rows, generator=gen) if gated else None
        with torch.set_grad_enabled(grad):
            outs = gated_nag_write(u, f, rho, g, alpha, beta, theta_max, w, b, d**0.5, backend="inductor")
            if grad:
                sum(o.sum() for o in outs).backward()

    def variants():
        return sum(len(v) for v in compiled._compiled.values())

    write(16, 0.5, False, True, layer=2)  # compiles the forward and the backward
    before = variants()
    for gated, grad, rows, layer in [(True, True, (6,), 1), (False, False, (9,), 0), (True, True, (13,), 0)]:
        write(16, 0.5, gated, grad, rows, layer)
    assert variants() == before
    for layer, bound in enumerate((1.5, 0.9, 0.7)):  # a bound is a tensor argument, not a setting
        write(16, bound, True, True, layer=layer)
    assert variants() == before
    assert not compiled._failed


class HeldCompilation:
    """A stand-in for a compiled variant whose compilation finishes when `done` is set: it then
    runs the function as written and says so (`compiled` in the result)."""

    made: list[str] = []
    done = threading.Event()

    def __init__(self, fn, values, names):
        assert HeldCompilation.done.wait(60)
        HeldCompilation.made.append(fn.__name__)
        self.fn, self.values, self.names = fn, values, names

    def accepts(self, given):
        return True

    def __call__(self, tensors):
        given = iter(tensors)
        values = [next(given) if isinstance(v, torch.Tensor) else v for v in self.values]
        return "compiled", self.fn(*values)


class RecordingCompilation(HeldCompilation):
    """A held compilation that returns what the function returns, as a compiled variant does."""

    def __call__(self, tensors):
        return super().__call__(tensors)[1]


def compile_with(monkeypatch, variant: type) -> None:
    """A fresh compilation state whose variants are `variant`s."""
    monkeypatch.setattr(compiled, "_compiled", {})
    monkeypatch.setattr(compiled, "_pending", set())
    monkeypatch.setattr(compiled, "_failed", False)
    monkeypatch.setattr(compiled, "_Variant", variant)
    monkeypatch.setattr(HeldCompilation, "made", [])


def doubled(x):
    return x * 2


def test_background_compilation_runs_the_function_as_written_until_it_is_ready(monkeypatch):
    """`auto`'s path (`wait=False`): the first calls do not wait for the compiler, and ask for
    one compilation however often they come; once it is ready, calls take the compiled variant.
    `wait=True` (`kernel: inductor`) compiles before it returns."""
    compile_with(monkeypatch, HeldCompilation)
    HeldCompilation.done.clear()
    x = torch.arange(3.0)
    for _ in range(3):  # the compilation is held: each call runs the function itself
        assert torch.equal(compiled.call(doubled, x, wait=False), 2 * x)
    HeldCompilation.done.set()
    assert compiled.wait_until_compiled(5)
    label, value = compiled.call(doubled, x, wait=False)
    assert label == "compiled" and torch.equal(value, 2 * x)
    assert HeldCompilation.made == ["doubled"]  # asked for once
    label, _ = compiled.call(doubled, x.view(3, 1) + 1, wait=True)  # another setting (dimensions)
    assert label == "compiled" and HeldCompilation.made == ["doubled", "doubled"]


def test_a_model_of_many_sublayers_compiles_one_write(monkeypatch):
    """The default NAG (each sublayer its own bound) at a size `auto` compiles for: one forward and
    one backward variant for all its sublayers, compiled in the background while the model trains
    on the reference."""
    from nag_lightning.model.config import TransformerConfig
    from nag_lightning.model.transformer import Transformer

    compile_with(monkeypatch, RecordingCompilation)
    HeldCompilation.done.set()
    model = Transformer(TransformerConfig(d_model=64, n_layers=4, seq_len=64, residual="nag"))
    batch = torch.randint(0, 256, (compiled.MIN_ELEMENTS // (64 * 64), 64))
    for _ in range(2):
        model(batch).logits.sum().backward()
        assert compiled.wait_until_compiled(5)
    assert sorted(HeldCompilation.made) == ["gated_write_backward", "gated_write_forward"]


@pytest.mark.parametrize("rows", [(1,), (2, 3), (3, 1700), (1, 5)], ids=lambda r: "x".join(map(str, r)))
def test_compiled_write_serves_any_rows_and_strides(rows):
    """One compiled variant is called directly, without dynamo's guards: it must refuse what it
    was not traced for (a dimension of 1, more rows than inductor's size hints, strides of a
    view) and compile another, never compute from a wrong layout; a layer's row of a parameter
    starts anywhere in its storage."""
    gen = torch.Generator().manual_seed(len(rows))
    d = 16
    x = {"u": torch.nn.functional.normalize(torch.randn(*rows, d, generator=gen), dim=-1),
         "f": torch.randn(*rows, 2 * d, generator=gen), "rho": torch.randn(rows, generator=gen),
         "g": torch.rand(rows, generator=gen), "alpha": torch.tensor([0.2, 0.7]), "beta": torch.tensor(0.3),
         "gate_w": 0.3 * torch.randn(3, d, generator=gen), "gate_b": torch.tensor(0.1)}

    def values_and_grads(backend, strided):
        # the leaves are the whole tensors; the write gets views of them, as a model's writes do
        leaves = {k: v.clone().requires_grad_() for k, v in x.items()}
        f = leaves["f"][..., ::2] if strided else leaves["f"][..., :d]  # every other column, or the first d
        given = leaves | {"f": f, "alpha": leaves["alpha"][1], "gate_w": leaves["gate_w"][2]}
        outs = gated_nag_write(**given, theta_max=0.9, gain=4.0, backend=backend)
        weights = [torch.linspace(-1, 1, o.numel()).view(o.shape) for o in outs]
        return outs, torch.autograd.grad(loss_of(outs, weights), list(leaves.values()))

    for strided in (False, True):  # the strided f must refuse the variant the other one compiled
        want_outs, want_grads = values_and_grads("torch", strided)
        for _ in range(2):  # the second call finds the variant the first compiled
            got_outs, got_grads = values_and_grads("inductor", strided)
            for got, want in zip([*got_outs, *got_grads], [*want_outs, *want_grads]):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not compiled._failed
