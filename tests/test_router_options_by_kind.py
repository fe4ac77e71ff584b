"""Router options per sublayer kind (`model.arch.router_options_by_kind`): attention and MLP routers
get their own rates; FLOP counts, `compare`, checkpoints and cached generation follow each."""

from __future__ import annotations

import pytest
import torch

from nag_lightning import Transformer, TransformerConfig
from nag_lightning.analysis.evaluation.generate import use_causal_routing
from nag_lightning.analysis.reports.compare import router_setting
from nag_lightning.model.flop_formula import router_flops_per_token
from nag_lightning.model.flops import count_model
from tests.test_inference import assert_cached_decoding_matches, full_routes

pytestmark = pytest.mark.usefixtures("one_thread")


def config(**changes) -> TransformerConfig:
    settings = dict(d_model=32, n_layers=2, n_heads=4, seq_len=64, residual="nag", router="topk",
                    router_options={"capacity": 0.5},
                    router_options_by_kind={"mlp": {"capacity": 0.25, "predictor_hidden": 8}}, init_std=0.02)
    return TransformerConfig(**{**settings, **changes})


def test_each_kind_gets_its_own_options():
    model = Transformer(config())
    assert [s.router.capacity for s in model.sublayers] == [0.5, 0.25, 0.5, 0.25]
    model.train()(torch.randint(0, 256, (2, 32)))
    count = count_model(model, 32)
    assert count.mod_rate == pytest.approx((0.5 + 0.75) / 2)  # attention skips half, the MLPs three quarters
    per_token = router_flops_per_token(model.cfg)
    assert per_token[0] == per_token[2] != per_token[1] == per_token[3]  # the MLPs' predictor is wider
    assert per_token == [s.router.flops_per_token() for s in model.train().sublayers]


def test_a_kind_that_is_not_routed_or_not_a_mapping_gets_one_sentence():
    with pytest.raises(ValueError, match="sets options for 'attn' sublayers, which route_kinds"):
        config(route_kinds=["mlp"], router_options_by_kind={"attn": {"capacity": 0.5}})
    with pytest.raises(ValueError, match="must be a mapping of router options"):
        config(router_options_by_kind={"mlp": 0.5})


def test_compare_names_the_options_of_each_kind():
    arch = {"router": "threshold", "router_options": {"predictor": "angle"},
            "router_options_by_kind": {"attn": {"target_rate": 0.25}, "mlp": {"target_rate": 0.75}}}
    assert router_setting(arch) == (
        "threshold predictor=angle; attn: target_rate=0.25; mlp: target_rate=0.75")


def test_cached_generation_with_rates_per_kind_computes_the_full_forward():
    idx = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = Transformer(config(router="threshold", router_options={"tau": 0.0},
                               router_options_by_kind={"mlp": {"tau": 10.0}}))  # attention runs, MLPs skip
    use_causal_routing(model)
    logits, executed = full_routes(model.eval(), idx)
    assert all(e.all() for e in executed[0::2]) and not any(e.any() for e in executed[1::2])
    assert_cached_decoding_matches(model, idx, logits)
