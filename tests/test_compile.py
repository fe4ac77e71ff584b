"""torch.compile of the Transformer (`nag_lightning.model.compile`): compiled training follows eager, and
routed models stop recompiling after their first steps.

Inductor on CPU compiles C++ with the system compiler: cold, that takes about a minute for one
tiny model, so the inductor tests are marked slow; the default suite checks the same training
through AOTAutograd without code generation (`aot_eager`), and the recompilation counts through a
counting backend (guards and recompilations are dynamo's, the same for every backend).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from nag_lightning import Transformer, TransformerConfig
from nag_lightning.model.compile import compile_model
from nag_lightning.residuals import RESIDUALS

pytestmark = pytest.mark.usefixtures("one_thread")

ROUTERS = {"topk": {"capacity": 0.5}, "threshold": {"target_rate": 0.25, "warmup_steps": 2}}


def train(model: Transformer, steps: int, seed: int = 1, on_step=None) -> list[float]:
    """`steps` AdamW steps on random bytes; the losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        batch = torch.randint(0, 256, (4, 17), generator=gen)
        out = model(batch[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten()) + out.aux_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step)
    return losses


def tiny(residual: str, router: str = "none", n_layers: int = 1) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(
        d_model=16, n_layers=n_layers, n_heads=2, seq_len=16, residual=residual, router=router,
        router_options=ROUTERS.get(router, {}),
    ))  # fmt: skip


def compiled_follows_eager(residual: str, backend: str) -> None:
    torch._dynamo.reset()
    eager = tiny(residual)
    compiled = compile_model(tiny(residual), backend=backend)
    want, got = train(eager, 3), train(compiled, 3)
    # it trains (on random bytes 3 losses are too noisy to fall reliably): the weights moved
    start = tiny(residual).parameters()
    assert all(not torch.equal(p, q) for p, q in zip(eager.parameters(), start, strict=True))
    assert all(math.isfinite(x) for x in want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=1e-4)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(q, p, atol=1e-4, rtol=1e-3, msg=name)
    assert eager.state_dict().keys() == compiled.state_dict().keys()  # checkpoints unchanged


@pytest.mark.parametrize("residual", ["nag", "prenorm"])
def test_compiled_training_follows_eager(residual):
    compiled_follows_eager(residual, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["nag", "prenorm"])
def test_inductor_training_follows_eager(residual):
    compiled_follows_eager(residual, "inductor")


def losses_and_gradients_agree(residual: str, router: str, backend: str) -> None:
    """Three AdamW steps side by side (the threshold router routes from the third): at every step
    the compiled model's loss and every parameter's gradient are the eager model's."""
    torch._dynamo.reset()
    eager, compiled = tiny(residual, router), compile_model(tiny(residual, router), backend=backend)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        batch = torch.randint(0, 256, (4, 17), generator=gen)
        losses = []
        for model in (eager, compiled):
            out = model(batch[:, :-1])
            loss = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten()) + out.aux_loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5, msg=f"loss, step {step}")
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=f"{name}, step {step}")
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    executed = [s.executed_per_seq.sum() for s in compiled.sublayers]
    assert router == "none" or min(executed) < 4 * 16  # the last step really skipped tokens


BUILT_IN_RESIDUALS = [n for n in RESIDUALS.names()
                      if RESIDUALS.get(n).__module__.startswith("nag_lightning.")]
# every residual unrouted; both routers on NAG and pre-norm, whose routed writes cover the two
# kinds of state (direction and norm lanes, one vector): the full grid is the slow test below
PAIRS = [(r, "none") for r in BUILT_IN_RESIDUALS] + [
    ("nag", "threshold"), ("prenorm", "threshold"), ("nag", "topk"), ("prenorm", "topk"),
]


@pytest.mark.parametrize(("residual", "router"), PAIRS)
def test_compiled_losses_and_gradients_follow_eager(residual, router):
    """Every residual routed, through AOTAutograd (routed models compile to one graph each, as
    unrouted ones do: seconds under aot_eager)."""
    losses_and_gradients_agree(residual, router, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("router", ["none", "topk", "threshold"])
@pytest.mark.parametrize("residual", BUILT_IN_RESIDUALS)
def test_compiled_losses_and_gradients_follow_eager_every_pair(residual, router):
    """Every residual under every router, through AOTAutograd."""
    losses_and_gradients_agree(residual, router, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("router", ["none", "topk", "threshold"])
@pytest.mark.parametrize("residual", BUILT_IN_RESIDUALS)
def test_inductor_losses_and_gradients_follow_eager(residual, router):
    """Every residual under every router, compiled by inductor (minutes: a C++ build per model)."""
    losses_and_gradients_agree(residual, router, "inductor")


class CountingBackend:
    """A torch.compile backend that runs graphs eagerly and counts compilations per step."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


@pytest.mark.parametrize("router", ["topk", "threshold"])
def test_routed_recompilations_stay_bounded(router):
    """12 steps of changing routing (the threshold router's executed counts change every step):
    graphs are compiled only in the first steps, the same number for 1 and 2 blocks."""
    counts = {}
    for n_layers in (1, 2):
        torch._dynamo.reset()
        backend = CountingBackend()
        per_step = []
        model = compile_model(tiny("nag", router, n_layers), backend=backend)
        executed = []

        def record(step, model=model, backend=backend, per_step=per_step, executed=executed):
            per_step.append(backend.graphs)
            executed.append(int(model.blocks[0].mlp.executed_per_seq.sum()))

        train(model, 12, on_step=record)
        counts[n_layers] = per_step
        if router == "threshold":
            assert len(set(executed[3:])) > 3  # the executed count really changes
        # warm-up (threshold: 2 steps of every token) and the first routed step compile;
        # dynamo then makes the executed count and the int attributes dynamic once: by step 4, done
        assert per_step[4] == per_step[-1], per_step
    # no graph break anywhere, so the whole model is one graph whatever the depth: top-k gathers
    # static shapes (one graph); the threshold router compiles its warm-up, its first routed step
    # and then the steps whose step counter dynamo has made dynamic (three)
    assert counts[1] == counts[2], counts
    assert counts[2][-1] == {"topk": 1, "threshold": 3}[router], counts


@pytest.mark.parametrize("compile", [False, True])
def test_lightning_module_compiles_in_configure_model(compile):
    from nag_lightning.training.module import LanguageModel

    arch = TransformerConfig(d_model=16, n_layers=1, n_heads=2, seq_len=16)
    module = LanguageModel(arch, compile=compile)
    keys = module.state_dict().keys()
    module.configure_model()
    module.configure_model()  # the hook may run more than once (fit, then test)
    assert (module.model._compiled_call_impl is not None) == compile
    assert module.state_dict().keys() == keys
