"""The threshold router's floor (`always_run_above`): a token the predictor rates at or above the
floor runs however high the target rate pushes tau; the controller keeps aiming at the target
quantile; generation with the KV cache computes what the full forward does."""

from __future__ import annotations

import pytest
import torch

from nag_lightning import Transformer, TransformerConfig
from nag_lightning.analysis.evaluation.generate import use_causal_routing
from nag_lightning.routers.threshold import ThresholdRouter
from tests.test_inference import assert_cached_decoding_matches, full_routes

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tokens_predicted_at_the_floor_run_whatever_tau_is():
    angles = torch.tensor([[0.1, 0.3, 0.5, 0.7, 1.2]])
    for floor, runs in ((None, [False, False, False, False, True]),
                        (0.5, [False, False, True, True, True])):
        router = ThresholdRouter(8, tau=1.0, predictor="angle", always_run_above=floor).eval()
        route = router(torch.zeros(1, 5, 8), planned_angle=angles)
        assert route.executed.tolist() == [runs]


def test_the_controller_aims_at_the_target_and_the_floor_lowers_the_rate():
    rates, taus = {}, {}
    for floor in (None, 1.0):
        router = ThresholdRouter(8, target_rate=0.75, predictor="angle", warmup_steps=0,
                                 always_run_above=floor).train()
        skipped = []
        for step in range(80):
            angles = torch.rand(4, 32, generator=torch.Generator().manual_seed(step)) * 2  # U(0, 2)
            x = torch.zeros(4, 32, 8)
            route = router(x, planned_angle=angles)
            skipped.append(1 - route.executed.float().mean().item())
            router.observe(x, route, None)
        rates[floor], taus[floor] = sum(skipped[-30:]) / 30, router.tau.item()
    assert rates[None] == pytest.approx(0.75, abs=0.05)
    assert rates[1.0] == pytest.approx(0.5, abs=0.05)  # every token above 1 rad runs: half of U(0, 2)
    assert taus[1.0] == pytest.approx(taus[None], rel=0.05)  # the controller's tau is unchanged


def test_a_floor_that_is_not_a_positive_angle_gets_one_sentence():
    with pytest.raises(ValueError, match="always_run_above is the predicted angle"):
        ThresholdRouter(8, target_rate=0.5, always_run_above=0.0)


def test_cached_generation_with_a_floor_computes_the_full_forward():
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(
        d_model=32, n_layers=2, n_heads=4, seq_len=64, residual="nag", router="threshold",
        router_options={"tau": 10.0, "always_run_above": 0.05}, init_std=0.02))
    use_causal_routing(model)
    for sublayer in model.sublayers:  # each floor at the median of its probe's predictions, far below tau
        seen = []
        hook = sublayer.router.register_forward_hook(
            lambda r, args, out, seen=seen: seen.append(r.predict(args[0]).median()))
        with torch.no_grad():
            model.eval()(idx)
        hook.remove()
        sublayer.router.always_run_above = float(seen[0])
    logits, executed = full_routes(model, idx)
    mixed = [e for e in executed if not e.all() and e.any()]
    assert mixed  # the floor, not tau, decides: some tokens run, some skip
    assert_cached_decoding_matches(model, idx, logits)
