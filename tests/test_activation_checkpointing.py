"""Activation checkpointing (`activation_checkpointing: true`): every block's forward runs again in
backward, routers included. For every residual strategy x router, a training step's gradients must
equal those without checkpointing, and a router that learns state outside the gradients (the
threshold router's tau and calibration) must end where it would have without it."""

from __future__ import annotations

import logging
import warnings

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from nag_lightning import RESIDUALS, ROUTERS, Transformer, TransformerConfig
from nag_lightning.training.module import LanguageModel

T = 24
pytestmark = pytest.mark.usefixtures("one_thread")

# Options under which each router skips tokens from the first step on (tau starts at 0, which
# skips nothing, so the threshold router's first, gradient-free forward below calibrates it).
OPTIONS = {"topk": {"capacity": 0.75}, "threshold": {"target_rate": 0.3, "warmup_steps": 0}}


def pair(residual: str, router: str) -> list[Transformer]:
    """The same model twice, without and with activation checkpointing."""
    models = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        cfg = TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=T, residual=residual,
                                router=router, router_options=OPTIONS.get(router, {}),
                                activation_checkpointing=checkpointing)
        models.append(Transformer(cfg).train())
    return models


def batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (3, T + 1), generator=torch.Generator().manual_seed(seed))


def loss_of(model: Transformer, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx[:, :-1])
    return F.cross_entropy(out.logits.flatten(0, 1), idx[:, 1:].flatten()) + out.aux_loss


def count_router_calls(model: Transformer) -> list[int]:
    calls = [0]
    for sublayer in model.sublayers:
        sublayer.router.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("residual", RESIDUALS.names())
@pytest.mark.parametrize("router", ROUTERS.names())
def test_gradients_match_without_checkpointing(residual, router):
    plain, checkpointed = pair(residual, router)
    with torch.no_grad():  # a training forward without gradients: the threshold router calibrates
        for model in (plain, checkpointed):
            loss_of(model, batch(0))
    calls = count_router_calls(checkpointed)
    losses, grads = [], []
    for model in (plain, checkpointed):
        loss = loss_of(model, batch(1))
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert calls[0] == 2 * len(checkpointed.sublayers)  # backward really ran every block again
    if router != "none":
        executed = sum(int(s.executed_per_seq.sum()) for s in checkpointed.sublayers)
        assert executed < len(checkpointed.sublayers) * 3 * T  # and tokens really were skipped
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=0)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("residual", ["nag", "prenorm"])
def test_threshold_state_after_training_is_the_same_with_checkpointing(residual):
    plain, checkpointed = pair(residual, "threshold")
    for model in (plain, checkpointed):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for step in range(8):
            optimizer.zero_grad()
            loss_of(model, batch(step)).backward()
            optimizer.step()
    checkpointed.apply_router_updates()  # the last step's update waits for it (or the next forward)
    for a, b in zip(plain.sublayers, checkpointed.sublayers):
        for name in ("tau", "tau_live", "bias_offset", "steps"):
            assert torch.equal(getattr(a.router, name), getattr(b.router, name)), name
        assert b.router._steps() == 8
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)


class RouterState(L.Callback):
    """The threshold routers' buffers at the end of every training batch, as checkpoints see them."""

    def __init__(self) -> None:
        self.states: list[list[float]] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.states.append([float(getattr(s.router, name)) for s in pl_module.model.sublayers
                            for name in ("tau", "tau_live", "bias_offset", "steps")])


def test_lightning_applies_the_updates_after_each_backward(tmp_path):
    """The LightningModule applies the pending updates after backward, so callbacks (and the
    checkpoints they write) see the same state at every step as without checkpointing."""
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    data = DataLoader(torch.stack([batch(i)[0] for i in range(12)]), batch_size=3)
    runs = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        arch = TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=T, router="threshold",
                                 router_options=OPTIONS["threshold"], activation_checkpointing=checkpointing)
        module = LanguageModel(arch, warmup_steps=1)
        record = RouterState()
        L.Trainer(accelerator="cpu", max_steps=4, callbacks=[record], logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  limit_val_batches=0, default_root_dir=tmp_path).fit(module, data)
        runs.append(record.states)
    assert len(runs[0]) == 4 and runs[0] == runs[1]
