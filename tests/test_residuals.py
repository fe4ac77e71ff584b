"""The residual strategies' invariants (DESIGN section 2) and their contribution angles (section 3)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nag_lightning.residuals import RESIDUALS, build_residual

D = 64
ROWS = 16


def nag(**options):
    return build_residual("nag", D, n_sublayers=8, **options)


def unit_state(strategy, rows=ROWS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return strategy.init_state(torch.randn(rows, D, generator=g) * 3.0)


def sublayer_outputs(u: torch.Tensor) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    random = torch.randn(u.shape, generator=g)
    return {
        "zero": torch.zeros_like(u),
        "parallel": 5.0 * u,
        "huge": 1e6 * random,
        "huge_parallel": 1e6 * u + random,
        "random": random,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["zero", "parallel", "huge", "huge_parallel", "random"])
def test_nag_write_keeps_unit_norm(case, dtype):
    strategy = nag()
    u, rho = unit_state(strategy)
    f = sublayer_outputs(u)[case].to(dtype)
    (u_new, _), _ = strategy.write((u, rho), f, None, index=0)
    assert u_new.dtype == torch.float32  # the direction lane stays fp32 under low-precision sublayers
    torch.testing.assert_close(u_new.norm(dim=-1), torch.ones(ROWS), atol=2e-6, rtol=0)


def test_nag_gate_zero_is_exact_identity():
    strategy = nag(beta_init=0.7)
    u, rho = unit_state(strategy)
    f = sublayer_outputs(u)["random"]
    (u_new, rho_new), angle = strategy.write((u, rho), f, torch.zeros(ROWS), index=3)
    assert torch.equal(u_new, u) and torch.equal(rho_new, rho)
    assert torch.equal(angle, torch.zeros(ROWS))


def test_nag_applied_angle_equals_theta_and_is_bounded():
    strategy = nag(alpha_init=2.0)
    u, rho = unit_state(strategy)
    for scale in (0.1, 1.0, 100.0):
        f = scale * sublayer_outputs(u)["random"]
        (u_new, _), theta = strategy.write((u, rho), f, None, index=0)
        applied = torch.acos((u * u_new).sum(-1).clamp(-1, 1))
        torch.testing.assert_close(applied, theta, atol=1e-3, rtol=0)
        assert (theta <= strategy.theta_max).all()
    # A huge update is bounded near theta_max, not wrapped around.
    assert theta.min() > 0.99 * strategy.theta_max


def test_nag_theta_does_not_depend_on_rho():
    strategy = nag(beta_init=0.5)
    u, rho = unit_state(strategy)
    f = sublayer_outputs(u)["random"]
    gate = torch.rand(ROWS)
    (u_a, _), theta_a = strategy.write((u, rho), f, gate, index=1)
    (u_b, rho_b), theta_b = strategy.write((u, rho + 10.0 * torch.randn(ROWS)), f, gate, index=1)
    assert torch.equal(theta_a, theta_b) and torch.equal(u_a, u_b)


def test_nag_rho_moves_with_the_radial_part():
    strategy = nag(beta_init=0.5)
    u, rho = unit_state(strategy)
    (_, rho_new), _ = strategy.write((u, rho), 2.0 * u, None, index=0)
    torch.testing.assert_close(rho_new, rho + 0.5 * 2.0 / math.sqrt(D))


def test_nag_init_and_readout_recover_the_embedding_norm():
    strategy = nag(norm_lane_readout=True)
    e = torch.randn(ROWS, D) * 2.0
    u, rho = strategy.init_state(e)
    torch.testing.assert_close(torch.exp(rho) * math.sqrt(D), e.norm(dim=-1))
    features, scale = strategy.final((u, rho))
    torch.testing.assert_close(features.norm(dim=-1), torch.full((ROWS,), math.sqrt(D)))
    torch.testing.assert_close(scale.squeeze(-1), torch.exp(rho.clamp(-4, 4)))
    assert nag(norm_lane_readout=False).final((u, rho))[1] is None  # the switch turns it off


def test_prenorm_contribution_shrinks_as_the_state_grows():
    strategy = build_residual("prenorm", D, n_sublayers=4)
    f = torch.randn(ROWS, D)
    x = torch.randn(ROWS, D)
    angles = [strategy.write((scale * x,), f, None, 0)[1].mean().item() for scale in (1, 10, 100)]
    assert angles[0] > angles[1] > angles[2] > 0
    (x_new,), angle = strategy.write((x,), f, None, 0)
    torch.testing.assert_close(x_new, x + f)
    expected = torch.acos(torch.nn.functional.cosine_similarity(x, x + f, dim=-1))
    torch.testing.assert_close(angle, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", RESIDUALS.names())
def test_every_strategy_gate_zero_is_identity(name):
    strategy = build_residual(name, D, n_sublayers=4)
    state = strategy.init_state(torch.randn(ROWS, D))
    new, angle = strategy.write(state, torch.randn(ROWS, D), torch.zeros(ROWS), 0)
    for before, after in zip(state, new, strict=True):
        assert torch.equal(before, after)
    assert angle is None or torch.equal(angle, torch.zeros(ROWS))


def test_nag_rejects_bad_options():
    with pytest.raises(ValueError, match="theta_max must be in"):
        nag(theta_max=0.0)
    with pytest.raises(ValueError, match="kernel must be one of"):
        nag(kernel="cuda")


def test_nag_defaults_scale_the_bound_with_depth_and_read_the_norm_lane():
    strategy = nag()  # 8 sublayers
    assert strategy.theta_max == 4 / 8 and strategy.norm_lane_readout and strategy.bound == "tanh"


def test_nag_checkpoint_carries_its_settings():
    """A state dict loads with the settings it was trained under, whatever the new model's."""
    trained = nag(theta_max=0.3, norm_lane_readout=False, bound="rational")
    loaded = nag()
    loaded.load_state_dict(trained.state_dict())
    assert (loaded.theta_max, loaded.norm_lane_readout, loaded.bound) == (0.3, False, "rational")
    with pytest.raises(ValueError, match="trained with theta_max=0.3; this model was given theta_max=0.5"):
        nag(theta_max=0.5).load_state_dict(trained.state_dict())


def test_nag_checkpoint_without_settings_gets_the_defaults_of_its_time():
    """State dicts from before the settings were saved: theta_max 2/N and no readout, unless given."""
    old = {k: v for k, v in nag().state_dict().items() if k != "_extra_state"}
    loaded = nag()
    loaded.load_state_dict(old)
    assert (loaded.theta_max, loaded.norm_lane_readout) == (2 / 8, False)
    given = nag(theta_max=1.0, norm_lane_readout=True)
    given.load_state_dict(old)
    assert (given.theta_max, given.norm_lane_readout) == (1.0, True)


@pytest.mark.parametrize("name", ["AtanBoundNAG", "LearnedBoundNAG"])
def test_bound_variants_of_the_experiments_folder_load_by_dotted_path(name, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "experiments"))
    strategy = build_residual(f"nag_bound_variants.{name}", D, n_sublayers=8, theta_max=0.2)
    u, rho = strategy.init_state(torch.randn(ROWS, D))
    f = torch.randn(ROWS, D, requires_grad=True)
    (u_new, _), theta = strategy.write((u, rho), f, None, 3)
    torch.testing.assert_close(u_new.norm(dim=-1), torch.ones(ROWS))
    assert (theta > 0).all() and (theta < 0.2).all()
    u_new.sum().backward()
    assert strategy.alpha.grad[3] != 0
