"""The analytic FLOP count against torch's FlopCounterMode on real forward passes, for every residual
strategy x router, and the bookkeeping around it (parameters, full depth, the per-step path)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nag_lightning import RESIDUALS, ROUTERS, Route, Router, Transformer, TransformerConfig
from nag_lightning.model.flops import (
    TransformerFlopCounter,
    count_flops,
    count_model,
    flop_counter_mode,
    full_depth_forward_flops,
    reference_training_flops,
    sublayer_params,
)

T = 12  # not a power of two, so a padding or rounding slip shows


class UnevenRouter(Router):
    """Test router: sequence b runs the tokens at positions divisible by b + 2 (6, 4, 3, ... of 12),
    so every sequence of a batch executes a different number of tokens. Scores with a linear
    probe for its gate, so it also spends router FLOPs."""

    def __init__(self, d_model: int) -> None:
        super().__init__(d_model)
        self.score = nn.Linear(d_model, 1, bias=False)

    def forward(self, h: Tensor) -> Route:
        B, T_, _ = h.shape
        t = torch.arange(T_, device=h.device)
        b = torch.arange(B, device=h.device).unsqueeze(1)
        return Route(executed=t % (b + 2) == 0, gate=torch.sigmoid(self.score(h).squeeze(-1)))

    def flops_per_token(self) -> int:
        return 2 * self.d_model


class SignRouter(Router):
    """Test router: a token runs when the first channel of its read input is positive (and the first
    token always), so executed counts depend on the data and differ across sequences and ranks."""

    def forward(self, h: Tensor) -> Route:
        executed = h[..., 0] > 0
        executed[:, 0] = True
        return Route(executed=executed)


# Options that make the built-in routers skip tokens from the first passes on (routers registered
# later are tested with their defaults).
ROUTE_OPTIONS = {"topk": {"capacity": 0.5}, "threshold": {"target_rate": 0.3, "warmup_steps": 0}}
UNEVEN = f"{__name__}.UnevenRouter"


def tiny(residual: str = "nag", router: str = "none", **overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(d_model=24, n_layers=2, n_heads=2, mlp_ratio=2.5, seq_len=16, residual=residual,
               router=router)
    return Transformer(TransformerConfig(**{**cfg, **overrides}))


def measure(model: Transformer, idx: Tensor, backend: str) -> int:
    """FlopCounterMode's total of one forward: under the math backend attention is plain bmm's that
    torch's own formulas count; the fused CPU kernel needs `flop_counter_mode`'s formula."""
    if backend == "math":
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(idx)
    else:
        with flop_counter_mode() as counter:
            model(idx)
    return counter.get_total_flops()


@pytest.mark.parametrize("backend", ["math", "fused"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("router", ROUTERS.names())
@pytest.mark.parametrize("residual", RESIDUALS.names())
def test_analytic_count_matches_flop_counter_mode(residual, router, training, backend):
    """Exact, in both modes: a router may run more in training than in evaluation (the threshold
    probe runs again in `observe`), and each mode counts what it ran."""
    model = tiny(residual, router, router_options=ROUTE_OPTIONS.get(router, {}))
    idx = torch.randint(0, 256, (3, T))
    model(idx)  # one training pass first: past any router's first-step special case
    measured = measure(model.train(training), idx, backend)
    counted = count_model(model, T)
    assert counted.forward == measured
    assert measured > counted.head  # attention and MLPs were really counted
    if router in ROUTE_OPTIONS:
        assert counted.mod_rate > 0  # the routed path really ran


def measure_training(model: Transformer, idx: Tensor, backend: str) -> int:
    """FlopCounterMode's total of one training pass, forward and backward of the loss and the
    auxiliary losses; the fused CPU attention's backward counted by `flop_counter_mode`."""
    def train_step():
        out = model(idx)
        (out.logits.float().logsumexp(-1).mean() + out.aux_loss).backward()

    if backend == "math":
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            train_step()
    else:
        with flop_counter_mode() as counter:
            train_step()
    return counter.get_total_flops()


@pytest.mark.parametrize("backend", ["math", "fused"])
@pytest.mark.parametrize("router", ROUTERS.names())
@pytest.mark.parametrize("residual", RESIDUALS.names())
def test_training_count_matches_flop_counter_mode_of_forward_and_backward(residual, router, backend):
    """3 x forward, but a router's backward is its own: top-k's predictor and the threshold probe
    read a detached input, so they have no input gradient. The fused CPU attention's backward
    counts what math attention's matrix products do."""
    model = tiny(residual, router, router_options=ROUTE_OPTIONS.get(router, {}))
    counter = TransformerFlopCounter(model)
    idx = torch.randint(0, 256, (3, T))
    model(idx)  # past any router's first-step special case
    measured = measure_training(model, idx, backend)
    assert count_model(model, T).training == measured
    assert counter.step().training.item() == measured
    counter.remove()


@pytest.mark.parametrize("backend", ["math", "fused"])
@pytest.mark.parametrize("residual", RESIDUALS.names())
def test_uneven_executed_counts_across_the_batch(residual, backend):
    model = tiny(residual, UNEVEN)
    idx = torch.randint(0, 256, (3, T))
    measured = measure(model, idx, backend)
    counts = torch.stack([s.executed_per_seq for s in model.sublayers])
    assert counts.tolist() == [[6, 4, 3]] * 4  # uneven, so the padded width K = 6 matters
    counted = count_model(model, T)
    assert counted.forward == pytest.approx(measured, rel=0.02)
    # Attention ran on the padded (3, 6, 6) block: 4 C K^2 per sequence and attention sublayer.
    assert counted.attention == 2 * 3 * 4 * 24 * 6 * 6
    # The causal pairs among executed tokens alone are fewer: n(n+1)/2 for n = 6, 4, 3.
    assert counted.attention_useful == 2 * 4 * 24 * (21 + 10 + 6)
    assert counted.mod_rate == pytest.approx(1 - 13 / 36)


def test_routing_only_some_sublayers():
    model = tiny("nag", UNEVEN, route_kinds=["mlp"], route_layers=[1])
    idx = torch.randint(0, 256, (3, T))
    measured = measure(model, idx, "math")
    counted = count_model(model, T)
    assert [s.executed for s in counted.sublayers] == [36, 36, 36, 13]
    assert [s.router > 0 for s in counted.sublayers] == [False, False, False, True]
    assert counted.forward == pytest.approx(measured, rel=0.02)


def test_sublayer_parameters_are_the_modules_weights():
    model = tiny()
    for sublayer in model.sublayers:
        weights = sum(p.numel() for p in sublayer.compute.parameters())
        assert sublayer_params(model.cfg, sublayer.kind) == weights


def test_the_count_takes_the_architecture_from_the_model():
    """Kinds in the model's order and a SwiGLU width that int() rounds down: the count, asked of
    the config, describes the modules the model builds."""
    cfg = TransformerConfig(d_model=32, n_layers=3, n_heads=4, mlp_ratio=2.7)
    model = Transformer(cfg)
    assert [s.kind for s in model.sublayers] == cfg.sublayer_kinds
    assert [s.kind for s in count_flops(cfg, [[T]] * cfg.n_sublayers, T).sublayers] == cfg.sublayer_kinds
    assert model.blocks[0].mlp.compute.proj.in_features == cfg.mlp_hidden == 86
    assert sublayer_params(cfg, "mlp") == sum(p.numel() for p in model.blocks[0].mlp.compute.parameters())


def test_full_depth_and_reference_budget():
    model = tiny("prenorm")
    idx = torch.randint(0, 256, (2, 16))
    measured = measure(model, idx, "math")
    assert full_depth_forward_flops(model.cfg) * 2 == measured
    assert reference_training_flops(model.cfg, tokens=32 * 5) == 3 * measured * 5
    dense = count_model(model, 16)
    assert dense.executed_fraction == 1.0 and dense.mod_rate == 0.0
    assert dense.executed_params_per_token == dense.layer_params


def test_routed_run_executes_a_fraction_of_the_layers():
    model = tiny("nag", UNEVEN)
    model(torch.randint(0, 256, (3, T)))
    counted = count_model(model, T)
    assert 0 < counted.executed_fraction < 1
    assert counted.layers / counted.full_depth_layers == counted.executed_fraction
    assert counted.executed_params_per_token == pytest.approx(counted.layer_params * 13 / 36)
    assert counted.training == 3 * counted.forward


def test_per_step_counter_counts_the_threshold_probe_of_training():
    """The training counter counts a training pass's routers, whatever mode the model is in when
    step() is asked, and that equals FlopCounterMode's measurement of the training pass."""
    model = tiny("nag", "threshold", router_options=ROUTE_OPTIONS["threshold"])
    counter = TransformerFlopCounter(model)
    idx = torch.randint(0, 256, (3, T))
    model(idx)
    measured = measure(model, idx, "math")
    model.eval()
    step = counter.step()
    assert step.forward.item() == measured
    routed = len(model.sublayers)
    assert measured - count_model(model, T).forward == routed * 2 * 24 * idx.numel()  # eval: once
    counter.remove()


def test_per_step_counter_agrees_with_the_breakdown():
    model = tiny("nag", UNEVEN)
    counter = TransformerFlopCounter(model)
    model(torch.randint(0, 256, (3, T)))
    step = counter.step()
    counted = count_model(model, T)
    assert step.forward.item() == counted.forward
    assert step.layer.item() == counted.layers
    assert step.full_depth_layer.item() == counted.full_depth_layers
    assert step.executed_params.item() == counted.executed_params
    assert (step.tokens.item(), step.samples.item()) == (3 * T, 3)
    assert counter.full_depth_forward_flops_per_token() == full_depth_forward_flops(model.cfg) / 16
    counter.remove()


def test_count_flops_refuses_impossible_counts():
    cfg = tiny().cfg
    with pytest.raises(ValueError, match="shape"):
        count_flops(cfg, [[4, 4]], seq_len=8)
    with pytest.raises(ValueError, match="seq_len"):
        count_flops(cfg, [[9]] * cfg.n_sublayers, seq_len=8)


def test_hand_count_of_one_dense_block():
    """One block, one sequence, by hand: the formula itself, not only its agreement."""
    cfg = TransformerConfig(d_model=8, n_layers=1, n_heads=2, mlp_ratio=2.0, seq_len=4, vocab_size=10)
    C, H, V, T_ = 8, 16, 10, 4
    expected = T_ * (8 * C * C + 6 * C * H + 2 * C * V) + 4 * C * T_ * T_
    assert count_flops(cfg, [[T_], [T_]], T_, [0, 0]).forward == expected
    # Attention runs 2 of 4 tokens (a padded 2 x 2 block), the MLP all 4.
    executed = 2 * 8 * C * C + 4 * C * 2 * 2 + T_ * 6 * C * H
    full = T_ * (8 * C * C + 6 * C * H) + 4 * C * T_ * T_
    assert math.isclose(count_flops(cfg, [[2], [T_]], T_, [0, 0]).executed_fraction, executed / full)
