"""The routers' skip-rate warm-up (full_depth_share, ramp_share) and the inner-blocks routing
option: every token runs at first, the rate ramps to its target, the Trainer drives it from the
steps or the FLOP budget, and the FLOP accounting counts what really ran."""

from __future__ import annotations

import logging
import math
import warnings

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from nag_lightning import Transformer, TransformerConfig
from nag_lightning.callbacks import FlopAccounting, FlopBudget
from nag_lightning.routers.threshold import ThresholdRouter
from nag_lightning.routers.topk import TopKRouter
from nag_lightning.training.module import LanguageModel

T = 32
pytestmark = pytest.mark.usefixtures("one_thread")


def h(batch: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, T, 16, generator=torch.Generator().manual_seed(seed))


def skipped(router, x: torch.Tensor) -> float:
    route = router(x)
    return 0.0 if route.executed is None else 1.0 - route.executed.float().mean().item()


@pytest.mark.parametrize("progress, capacity",
                         [(0.0, 1.0), (0.1, 1.0), (0.2, 0.9375), (0.25, 0.9375), (0.3, 0.875),
                          (0.45, 0.8125), (0.5, 0.75), (0.9, 0.75)])
def test_topk_capacity_follows_the_warmup(progress, capacity):  # in quarters of the ramp
    router = TopKRouter(16, capacity=0.75, full_depth_share=0.1, ramp_share=0.4).train()
    router.set_progress(progress)
    assert skipped(router, h()) == pytest.approx(1 - math.ceil(capacity * T) / T)


def test_topk_evaluation_and_an_untouched_router_route_at_the_target():
    router = TopKRouter(16, capacity=0.75, full_depth_share=0.5, eval_routing="topk")
    router.set_progress(0.0)
    assert skipped(router.eval(), h()) == pytest.approx(0.25)  # evaluation: the trained capacity
    fresh = TopKRouter(16, capacity=0.75, full_depth_share=0.5).train()  # nothing set its progress
    assert skipped(fresh, h()) == pytest.approx(0.25)


def test_threshold_router_runs_every_token_then_aims_at_the_ramped_rate():
    router = ThresholdRouter(16, target_rate=0.4, warmup_steps=0, full_depth_share=0.2,
                             ramp_share=0.4).train()
    router.set_progress(0.1)
    x = h()
    route = router(x)
    assert route.executed is None  # full depth
    router.observe(x, route, torch.rand(4, T))
    router.set_progress(0.4)  # half way up the ramp: aim at 20%
    assert router.rate_now.item() == pytest.approx(0.2)
    rates = []
    for step in range(60):
        x = h(seed=step)
        route = router(x)
        rates.append(1 - route.executed.float().mean().item())
        router.observe(x, route, torch.rand(4, T))
    assert sum(rates[-20:]) / 20 == pytest.approx(0.2, abs=0.05)
    router.set_progress(1.0)
    assert router.rate_now.item() == pytest.approx(0.4)


@pytest.mark.parametrize("options, message", [
    ({"full_depth_share": -0.1}, "full_depth_share is a share of training"),
    ({"ramp_share": 1.5}, "ramp_share is a share of training"),
    ({"full_depth_share": 0.6, "ramp_share": 0.6}, "more than the whole run"),
])
@pytest.mark.parametrize("router", [TopKRouter, ThresholdRouter])
def test_bad_warmup_shares_get_one_sentence(router, options, message):
    extra = {"target_rate": 0.25} if router is ThresholdRouter else {}
    with pytest.raises(ValueError, match=message):
        router(16, **extra, **options)


def test_a_ramp_needs_a_target_rate():
    with pytest.raises(ValueError, match="set target_rate"):
        ThresholdRouter(16, tau=0.1, ramp_share=0.5)


def test_inner_routes_every_block_but_the_first_and_last():
    cfg = TransformerConfig(d_model=16, n_layers=4, n_heads=2, seq_len=T, router="topk", route_layers="inner")
    assert cfg.routed_layers() == {1, 2}
    model = Transformer(cfg)
    assert [s.routed for s in model.sublayers] == [False, False, True, True, True, True, False, False]


def fit(router_options: dict, steps: int, callbacks: list) -> tuple[LanguageModel, list[float]]:
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    torch.manual_seed(0)
    arch = TransformerConfig(d_model=16, n_layers=2, n_heads=2, seq_len=16, router="topk",
                             router_options={"capacity": 0.5, **router_options})
    module = LanguageModel(arch, warmup_steps=1, lr=1e-2)
    executed: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            runs = pl_module.model.sublayers[0].executed_per_seq
            executed.append(runs.float().mean().item() / 16)

    data = torch.randint(0, 256, (8 * 4, 17), generator=torch.Generator().manual_seed(1))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[*callbacks, Record()])
    trainer.fit(module, DataLoader(data, batch_size=4))
    return module, executed


def test_the_trainer_ramps_the_rate_over_the_steps():
    _, executed = fit({"full_depth_share": 0.25, "ramp_share": 0.5}, 8, [])
    # steps 0-1 full depth; 2-5 ramp (progress 2/8 .. 5/8 -> a quarter to three quarters of 50%)
    assert executed == pytest.approx([1, 1, 1, 14 / 16, 12 / 16, 10 / 16, 8 / 16, 8 / 16])


def test_under_a_flop_budget_the_ramp_follows_the_budget_and_costs_what_ran():
    budget = FlopBudget(reference_tokens=6 * 4 * 16)  # six full-depth steps
    accounting = FlopAccounting()
    spent: list[float] = []
    accounting.add_listener(lambda trainer, acc: spent.append(acc.last["step"]))
    module, executed = fit({"full_depth_share": 0.5}, 100, [accounting, budget])
    # full depth until half the budget is spent, then half the tokens, which the accounting counts
    # as they ran; the run stops at the first step whose total reaches the budget
    full = executed.index(0.5)
    assert executed[:full] == [1] * full and set(executed[full:]) == {0.5}
    assert sum(spent[:full - 1]) < budget.budget / 2 <= sum(spent[:full])
    assert spent[0] == spent[full - 1] > spent[full] == spent[-1]
    assert sum(spent[:-1]) < budget.budget <= sum(spent) == accounting.training_flops


@pytest.mark.parametrize("router, options", [
    ("topk", {"capacity": 0.75}),
    ("threshold", {"target_rate": 0.25}),
    ("threshold", {"target_rate": 0.25, "predictor": "angle"}),
])
def test_the_routers_auxiliary_losses_train_only_their_own_predictors(router, options):
    """The predictors read the stream detached, so their losses cannot pull the model away from the
    language loss: the gradient of the auxiliary loss reaches no weight outside the routers'
    predictors (with NAG's default, whose angle is unpriced)."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=16, n_layers=2, n_heads=2, seq_len=T, residual="nag",
                                          router=router, router_options=options)).train()
    idx = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the threshold router regresses from its second pass on
        aux = model(idx).aux_loss
    if not aux.requires_grad:
        assert aux.item() == 0.0  # the angle router has nothing to learn
        return
    aux.backward()
    touched = {name for name, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert touched and all(".predictor." in name or ".probe." in name for name in touched), touched
