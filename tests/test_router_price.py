"""The threshold router's price on the planned angle (`angle_cost`): it joins the auxiliary loss of
the routed sublayers only, ramps with the skip-rate warm-up, and needs the angle predictor."""

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
    gate = priced.strategy.gate_w.grad
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
