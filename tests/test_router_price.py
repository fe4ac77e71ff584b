"""The threshold router's price on the planned angle (`angle_cost`): it joins the auxiliary loss of
the routed sublayers only, ramps with the skip-rate warm-up (or from `price_start`, a late price),
and needs the angle predictor."""

from __future__ import annotations

import pytest
import torch

from nag_lightning import Transformer, TransformerConfig
from nag_lightning.routers.threshold import ThresholdRouter

pytestmark = pytest.mark.usefixtures("one_thread")


def model(angle_cost: float) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(
        d_model=32, n_layers=2, n_heads=4, seq_len=64, residual="nag", router="threshold",
        router_options={"predictor": "angle", "target_rate": 0.5, "angle_cost": angle_cost,
                        "warmup_steps": 0}, route_kinds=["mlp"])).train()


def test_the_price_is_the_mean_planned_angle_of_the_routed_sublayers_only():
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert model(0.0)(idx).aux_loss.item() == 0.0  # the angle predictor learns nothing
    priced = model(0.1)
    priced.record_diagnostics(True)
    out = priced(idx)
    planned = [s.planned_angle.mean() for s in priced.sublayers if s.kind == "mlp"]
    assert out.aux_loss.item() == pytest.approx(0.1 * sum(planned).item(), rel=1e-5)
    out.aux_loss.backward()
    gate = priced.strategy.angle.gate_w.grad
    assert gate[1::2].abs().sum() > 0 and gate[0::2].abs().sum() == 0  # MLPs priced, attention not
    assert priced.sublayers[1].router.stats()["angle_price"] > 0


def test_the_price_follows_the_warm_up_and_evaluation_pays_none():
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    priced = model(0.1)
    for s in priced.sublayers:
        s.router.set_rate_warmup(0.5, 0.0)
        s.router.set_progress(0.25)  # at full depth: no price
    assert priced(idx).aux_loss.item() == 0.0
    with torch.no_grad():
        assert priced.eval()(idx).aux_loss.item() == 0.0


def test_a_price_without_the_angle_predictor_gets_one_sentence():
    with pytest.raises(ValueError, match="angle_cost prices the planned angle"):
        ThresholdRouter(8, target_rate=0.5, angle_cost=0.1)
    with pytest.raises(ValueError, match="angle_cost prices the planned angle"):
        ThresholdRouter(8, predictor="angle", angle_cost=-1.0)


def test_a_late_price_is_zero_before_price_start_and_ramps_to_angle_cost():
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    full = model(0.1)(idx).aux_loss.item()
    late = model(0.1)
    routers = [s.router for s in late.sublayers if s.kind == "mlp"]
    for r in routers:
        r.price_start, r.price_ramp = 0.5, 0.2
    for progress, share in ((0.0, 0.0), (0.49, 0.0), (0.55, 0.25), (0.6, 0.5), (0.7, 1.0), (1.0, 1.0)):
        for r in routers:
            r.set_progress(progress)
        assert late(idx).aux_loss.item() == pytest.approx(share * full, rel=1e-5, abs=1e-9)
    step = ThresholdRouter(8, predictor="angle", target_rate=0.5, angle_cost=0.1, price_start=0.5)
    step.set_progress(0.49)
    assert step.price_scale == 0.0
    step.set_progress(0.5)
    assert step.price_scale == 1.0


def test_a_price_schedule_without_a_price_or_past_the_run_gets_one_sentence():
    with pytest.raises(ValueError, match="price_start and price_ramp schedule the router's price"):
        ThresholdRouter(8, predictor="angle", target_rate=0.5, price_start=0.5)
    with pytest.raises(ValueError, match="price_start \\+ price_ramp is 1.2, more than the whole run"):
        ThresholdRouter(8, predictor="angle", target_rate=0.5, angle_cost=0.1,
                        price_start=0.7, price_ramp=0.5)
    with pytest.raises(ValueError, match="price_ramp is a share of training"):
        ThresholdRouter(8, predictor="angle", target_rate=0.5, angle_cost=0.1, price_ramp=-0.1)


def test_a_late_price_leaves_evaluation_and_its_routes_unchanged():
    """The price is a training loss only: with the same weights and thresholds, a late-priced model
    evaluates (logits, routes, no auxiliary loss) exactly as an unpriced one, so the KV cache,
    `generate` and the FLOP counts see the same router."""
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    late, free = model(0.1), model(0.0)
    for r in late.sublayers:
        r.router.price_start, r.router.price_ramp = 0.5, 0.2
        r.router.set_progress(0.9)
    late(idx)  # one training forward sets the thresholds
    free.load_state_dict(late.state_dict())
    late.eval(), free.eval()
    late.record_diagnostics(True), free.record_diagnostics(True)
    with torch.no_grad():
        a, b = late(idx), free(idx)
    assert torch.equal(a.logits, b.logits) and a.aux_loss.item() == 0.0
    for x, y in zip(late.sublayers, free.sublayers):
        assert (x.executed is None and y.executed is None) or torch.equal(x.executed, y.executed)
