"""The sweep's protocol and oracle live in analysis: how a router class is found sweepable, what the
sweep says of one that is not, and that the oracle leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from nag_lightning.analysis.sweeps.oracle import OracleSublayer, oracle, under_oracle
from nag_lightning.analysis.sweeps.sweep import run_sweep
from nag_lightning.analysis.sweeps.sweepable import (
    OwnSweep,
    ThresholdSweep,
    TopKSweep,
    UnroutedSweep,
    sweep_of,
)
from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.routers import NoRouter, Route, Router
from nag_lightning.routers.threshold import ThresholdRouter
from nag_lightning.routers.topk import TopKRouter
from nag_lightning.training.module import LanguageModel


class KeepAll(Router):
    """A router of another package that implements nothing of the sweep's protocol."""

    def forward(self, h: Tensor) -> Route:
        return Route(executed=torch.ones(h.shape[:2], dtype=torch.bool, device=h.device))


class OwnThreshold(ThresholdRouter):
    """A subclass of a built-in router with a sweep of its own."""

    sweep_setting = "tau"


def arch(**options) -> TransformerConfig:
    return TransformerConfig(d_model=16, n_layers=2, n_heads=2, seq_len=16, **options)


def test_each_router_class_finds_its_sweep():
    assert isinstance(sweep_of(ThresholdRouter), ThresholdSweep)
    assert isinstance(sweep_of(TopKRouter), TopKSweep)
    assert isinstance(sweep_of(NoRouter), UnroutedSweep) and sweep_of(NoRouter).setting is None
    own = sweep_of(OwnThreshold)  # its own members win over the adapter of the class it extends
    assert isinstance(own, OwnSweep) and own.cls is OwnThreshold
    assert sweep_of(KeepAll) is None
    for member in ("sweep_setting", "sweeping", "default_sweep_values", "for_sweep", "sweep_labels"):
        assert not hasattr(Router, member)


def test_a_router_without_the_protocol_trains_but_the_sweep_says_it_cannot_sweep_it():
    module = LanguageModel(arch(router=f"{__name__}.KeepAll"))
    batches = [torch.randint(0, 256, (2, 17))]
    loss, _ = module._loss(batches[0])
    loss.backward()  # it trains
    with pytest.raises(ValueError, match=r"^The router 'KeepAll' cannot be swept: it names no setting"):
        run_sweep(module, batches, None)


def test_the_oracle_stands_in_for_the_routed_sublayers_only_while_it_is_installed():
    torch.manual_seed(0)
    model = Transformer(arch(router="threshold", route_kinds=["mlp"])).eval()
    idx = torch.randint(0, 256, (2, 16))
    before = [s for s in model.sublayers]
    with torch.no_grad():
        with oracle(model, 0.0):
            assert under_oracle(model)
            assert [isinstance(s, OracleSublayer) for s in model.sublayers] == [False, True] * 2
            dense_by_oracle = model(idx).logits
        with oracle(model, 0.0, every_sublayer=True):
            assert all(isinstance(s, OracleSublayer) for s in model.sublayers)
        assert model.sublayers == before and not under_oracle(model)
        model.blocks[0].mlp.router.tau.fill_(0.0)
        model.blocks[1].mlp.router.tau.fill_(0.0)
        torch.testing.assert_close(dense_by_oracle, model(idx).logits)  # tau 0 keeps every write
        with oracle(model, 10.0):  # radians: no write reaches it
            model(idx)
            assert all(s.executed_per_seq.sum() == 0 for s in model.sublayers if s.routed)
