"""The NAG formulation families (docs/design.md, "Formulation families"): each keeps the rotation
picture's invariants, and each does what its option says."""

from __future__ import annotations

import math

import pytest
import torch

from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.residuals import build_residual

D, ROWS, N = 64, 16, 8

FAMILIES = {
    "gate, decaying bound (default)": ("nag", {}),
    "gate, flat bound (the earlier default)": ("nag", {"bound": "flat"}),
    "gate reads the update": ("nag", {"angle": "gate_update"}),
    "gate times the tangential share": ("nag", {"angle": "gate_tangent"}),
    "learned bound": ("nag", {"bound": "learned"}),
    "per-channel gain": ("nag", {"channel_scale": True}),
    "step": ("nag", {"angle": "magnitude", "saturation": "rational", "theta_max": math.pi / 2}),
    "planes": ("nag_planes", {"planes": 4}),
    "additive": ("nag", {"angle": "additive"}),
    "additive, learned inertia": ("nag", {"angle": "additive", "inertia": "lane", "beta_init": 0.5}),
    "inertial (Peri-LN's turn)": ("nag_inertial", {}),
    "inertial, tangential": ("nag_inertial", {"tangential": True}),
}


def build(name: str, options: dict):
    strategy = build_residual(name, D, n_sublayers=N, **options)
    with torch.no_grad():  # trained-looking parameters: angles differ between tokens and sublayers
        generator = torch.Generator().manual_seed(3)
        for param_name, param in strategy.named_parameters():
            if param_name in ("angle.gate_w", "angle.gate_v"):
                param.normal_(0.0, 0.3, generator=generator)
            elif param_name == "channel.gain":
                param.uniform_(0.5, 1.5, generator=generator)
            elif param_name == "bound.logit":
                param.normal_(0.0, 1.0, generator=generator)
    return strategy


def state_and_update(strategy, scale: float = 1.0, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    state = strategy.init_state(torch.randn(ROWS, D, generator=g) * 3.0)
    return state, scale * torch.randn(ROWS, D, generator=g)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("scale", [0.0, 1e-3, 1.0, 1e6])
def test_every_family_keeps_unit_norm_and_reports_the_angle_it_turned(family, scale):
    strategy = build(*FAMILIES[family])
    (u, rho), f = state_and_update(strategy, scale)
    (u_new, rho_new), theta = strategy.write((u, rho), f, None, 3)
    torch.testing.assert_close(u_new.norm(dim=-1), torch.ones(ROWS), atol=2e-6, rtol=0)
    applied = torch.acos((u * u_new).sum(-1).clamp(-1, 1))
    torch.testing.assert_close(applied, theta, atol=2e-3, rtol=0)
    assert torch.isfinite(rho_new).all()
    if scale == 0.0:
        assert torch.equal(theta, torch.zeros(ROWS))  # nothing written, nothing turned


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_is_an_exact_identity_at_gate_zero(family):
    strategy = build(*FAMILIES[family])
    (u, rho), f = state_and_update(strategy)
    (u_new, rho_new), theta = strategy.write((u, rho), f, torch.zeros(ROWS), 1)
    assert torch.equal(u_new, u) and torch.equal(rho_new, rho) and torch.equal(theta, torch.zeros(ROWS))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_and_its_checkpoint_loads_with_its_settings(family):
    name, options = FAMILIES[family]
    config = TransformerConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=16, residual=name,
                               residual_options=options)
    torch.manual_seed(0)
    model = Transformer(config)
    idx = torch.randint(0, 256, (2, 16))
    out = model(idx)
    (out.logits.float().logsumexp(-1).mean() + out.aux_loss).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    loaded = Transformer(config)
    loaded.load_state_dict(model.state_dict())
    torch.testing.assert_close(loaded.eval()(idx).logits, model.eval()(idx).logits)


@pytest.mark.parametrize("option", [{"angle": "gate_update"}, {"bound": "learned"},
                                    {"channel_scale": True}])
def test_a_checkpoint_loads_only_into_a_model_of_its_own_structure(option):
    """Parts or gains with parameters of their own: the model must be built with them."""
    trained = build("nag", option).state_dict()
    name, value = next(iter(option.items()))
    with pytest.raises(ValueError, match=f"trained with {name}={value}; this model was built with"):
        build("nag", {}).load_state_dict(trained, strict=False)


def test_the_tangent_gate_does_not_turn_a_state_its_update_agrees_with():
    strategy = build("nag", {"angle": "gate_tangent"})
    (u, rho), f = state_and_update(strategy)
    (_, _), along = strategy.write((u, rho), 5.0 * u + 1e-4 * f, None, 0)
    (_, _), across = strategy.write((u, rho), f - (f * u).sum(-1, keepdim=True) * u, None, 0)
    gate = strategy.angle.state_angle(u, 0, strategy.bound)
    assert (along < 1e-3).all()  # the default gate would turn these by the full gated angle
    torch.testing.assert_close(across, gate, atol=1e-4, rtol=0)  # f ⟂ u: the gated angle itself


def test_the_update_reading_gate_depends_on_what_was_written_and_plans_nothing():
    strategy = build("nag", {"angle": "gate_update"})
    (u, rho), f = state_and_update(strategy)
    (_, _), one = strategy.write((u, rho), f, None, 0)
    (_, _), other = strategy.write((u, rho), f.roll(1, -1), None, 0)
    (_, _), scaled = strategy.write((u, rho), 100.0 * f, None, 0)
    assert not torch.allclose(one, other)
    torch.testing.assert_close(one, scaled)  # the direction of f, not its size
    assert strategy.planned_angle((u, rho), 0) is None and not strategy.plans_angle


def test_the_learned_bound_starts_at_theta_max_and_stays_below_pi():
    strategy = build_residual("nag", D, n_sublayers=N, bound="learned")
    torch.testing.assert_close(strategy.bound.of(2), torch.tensor(strategy.bound.theta_max))
    with torch.no_grad():
        strategy.bound.logit.fill_(50.0)
    (u, rho), f = state_and_update(strategy)
    (_, _), theta = strategy.write((u, rho), f, None, 2)
    assert (theta <= math.pi).all() and theta.max() > strategy.bound.theta_max


def test_the_decaying_bound_keeps_the_flat_budget_and_turns_early_writes_more():
    n = 16  # 8 blocks: no bound reaches pi / 2
    flat = build_residual("nag", D, n_sublayers=n, bound="flat")
    decaying = build_residual("nag", D, n_sublayers=n)  # the default
    with torch.no_grad():  # the same trained-looking gates: only the bound differs
        for strategy in (flat, decaying):
            strategy.angle.gate_w.copy_(torch.randn(n, D, generator=torch.Generator().manual_seed(3)) * 0.3)
    bounds = [decaying.bound.of(i) for i in range(n)]
    theta_max = flat.bound.theta_max
    assert bounds == sorted(bounds, reverse=True) and bounds[0] > theta_max > bounds[-1]
    assert math.isclose(sum(b * b for b in bounds), n * theta_max**2, rel_tol=1e-9)
    (u, rho), f = state_and_update(flat)
    for index in (0, n - 1):
        (_, _), theta_flat = flat.write((u, rho), f, None, index)
        (_, _), theta = decaying.write((u, rho), f, None, index)
        # the same share of a different bound, and what the router plans is what the write turns
        torch.testing.assert_close(theta, theta_flat * bounds[index] / theta_max)
        torch.testing.assert_close(decaying.planned_angle((u, rho), index), theta)
    with pytest.raises(ValueError, match="bound must be one of"):
        build_residual("nag", D, n_sublayers=N, bound="cosine")


def test_the_bound_decays_by_default_only_for_the_gates():
    assert build_residual("nag", D, n_sublayers=N).bound.name == "decaying"
    assert build_residual("nag", D, n_sublayers=N, angle="gate_update").bound.name == "decaying"
    for name, options in (("nag", {"angle": "magnitude"}), ("nag", {"angle": "additive"}), ("nag_planes", {})):
        assert build_residual(name, D, n_sublayers=N, **options).bound.name == "flat"
    with pytest.raises(ValueError, match="The magnitude angle turns within a bound of flat; got bound='decaying'"):
        build_residual("nag", D, n_sublayers=N, angle="magnitude", bound="decaying")


def test_a_checkpoint_of_the_flat_bound_loads_flat_and_gives_its_outputs():
    """Saved before the bound had a schedule (no bound_schedule in its settings): it trained flat,
    and the model built with the default bound takes the flat one instead, neither having
    parameters."""
    from nag_lightning.checkpoints.compat import upgrade_nag_state

    config = TransformerConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=16,
                               residual="nag", residual_options={"bound": "flat"})
    torch.manual_seed(0)
    old = Transformer(config).eval()
    with torch.no_grad():
        old.strategy.angle.gate_w.normal_(0.0, 0.3)
    state = old.state_dict()
    # as the release before the bound had a schedule saved it: one flat dict, the gate on the residual
    state["strategy._extra_state"] = {"theta_max": state.pop("strategy.bound._extra_state")["theta_max"],
                                      "norm_lane_readout": True, "bound": "tanh", "angle": "gate",
                                      **state.pop("strategy.angle._extra_state")}
    state["strategy.gate_w"], state["strategy.gate_b"] = state.pop("strategy.angle.gate_w"), state.pop(
        "strategy.angle.gate_b")
    assert upgrade_nag_state(state, {}, prefix="strategy.") == {}
    loaded = Transformer(TransformerConfig(**{**config.__dict__, "residual_options": {}})).eval()
    assert loaded.strategy.bound.name == "decaying"
    loaded.load_state_dict(state)
    assert loaded.strategy.bound.name == "flat"
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(loaded(idx).logits, old(idx).logits)


def test_the_channel_gain_at_one_is_the_default_write():
    plain = build_residual("nag", D, n_sublayers=N)
    gained = build_residual("nag", D, n_sublayers=N, channel_scale=True)
    (u, rho), f = state_and_update(plain)
    (u1, r1), t1 = plain.write((u, rho), f, None, 0)
    (u2, r2), t2 = gained.write((u, rho), f, None, 0)
    for one, other in ((u1, u2), (r1, r2), (t1, t2)):
        torch.testing.assert_close(one, other)


def test_the_step_turns_by_the_size_of_the_update_and_not_along_the_state():
    strategy = build("nag", FAMILIES["step"][1])
    (u, rho), f = state_and_update(strategy)
    f_perp = f - (f * u).sum(-1, keepdim=True) * u
    (_, _), small = strategy.write((u, rho), 0.1 * f_perp, None, 0)
    (_, _), large = strategy.write((u, rho), 10.0 * f_perp, None, 0)
    (_, _), along = strategy.write((u, rho), 7.0 * u, None, 0)
    assert (small < large).all() and (large < math.pi / 2).all() and (along < 1e-6).all()


def test_planes_turn_each_group_on_its_own_sphere():
    strategy = build("nag_planes", {"planes": 4})
    (u, rho), f = state_and_update(strategy)
    f[:, 16:] = 0.0  # an update into the first group only
    (u_new, _), theta = strategy.write((u, rho), f, None, 0)
    groups, new_groups = u.unflatten(-1, (4, 16)), u_new.unflatten(-1, (4, 16))
    torch.testing.assert_close(new_groups.norm(dim=-1), torch.full((ROWS, 4), 0.5), atol=2e-6, rtol=0)
    torch.testing.assert_close(new_groups[:, 1:], groups[:, 1:])  # the other groups keep what they held
    assert (theta > 0).all()
    planned = strategy.planned_angle((u, rho), 0)
    assert planned.shape == (ROWS,) and (planned >= theta - 1e-5).all()  # f reaches one group of four


def test_the_additive_angle_turns_as_a_renormalised_additive_residual():
    strategy = build("nag", {"angle": "additive"})
    (u, rho), f = state_and_update(strategy)
    (u_new, _), theta = strategy.write((u, rho), f, None, 2)
    added = u + strategy.alpha[2].detach() * f / math.sqrt(D)
    torch.testing.assert_close(u_new, added / added.norm(dim=-1, keepdim=True), atol=2e-6, rtol=0)
    (_, _), against = strategy.write((u, rho), f - 3 * math.sqrt(D) * u, None, 2)
    assert (against > math.pi / 2).any()  # an update against the state turns it past a right angle


def test_the_gate_gain_scales_the_gates_dot_product_and_travels_in_checkpoints():
    slow = build_residual("nag", D, n_sublayers=N, gate_gain=1.0)
    gate = slow.angle
    with torch.no_grad():
        gate.gate_w.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(4))
    (u, rho), f = state_and_update(slow)
    expected = slow.bound.of(0) * torch.sigmoid(u @ gate.gate_w[0] + gate.gate_b[0])
    torch.testing.assert_close(slow.planned_angle((u, rho), 0), expected.detach())
    (_, _), theta = slow.write((u, rho), f, None, 0)
    torch.testing.assert_close(theta, expected.detach(), atol=1e-4, rtol=0)
    loaded = build_residual("nag", D, n_sublayers=N)
    loaded.load_state_dict(slow.state_dict())
    assert loaded.angle.gate_gain == 1.0
    with pytest.raises(ValueError, match="trained with gate_gain=1.0"):
        build_residual("nag", D, n_sublayers=N, gate_gain=2.0).load_state_dict(slow.state_dict())


def test_the_additive_angle_with_inertia_is_the_prenorm_stream():
    """NAG's lanes with the state's norm fed back into the step are pre-norm: the same weights give
    the same logits, so the one difference between NAG's additive angle and pre-norm is that
    feedback."""
    common = dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=16)
    torch.manual_seed(0)
    prenorm = Transformer(TransformerConfig(**common, residual="prenorm"))
    lanes = Transformer(TransformerConfig(**common, residual="nag", residual_options={
        "angle": "additive", "inertia": "norm", "norm_lane_readout": False}))
    missing, unexpected = lanes.load_state_dict(prenorm.state_dict(), strict=False)
    assert set(missing) == {"strategy.alpha", "strategy.beta", "strategy._extra_state",
                            "strategy.angle._extra_state", "strategy.bound._extra_state"} and not unexpected
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(lanes(idx).logits, prenorm(idx).logits, atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="'inertia', which the NAG angle 'gate' does not take"):
        build_residual("nag", D, n_sublayers=N, inertia="norm")


def test_the_inertial_family_without_its_readout_is_periln():
    """`nag_inertial` writes Peri-LN's stream in NAG's lanes: with Peri-LN's weights and no norm
    lane at the readout it gives Peri-LN's logits; the lane at the readout is the one difference."""
    common = dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, seq_len=16)
    torch.manual_seed(0)
    periln = Transformer(TransformerConfig(**common, residual="periln"))
    with torch.no_grad():  # gains away from 1, so that each is used where Peri-LN uses it
        for param in periln.strategy.parameters():
            param.uniform_(0.5, 1.5)
    lanes = Transformer(TransformerConfig(**common, residual="nag_inertial",
                                          residual_options={"norm_lane_readout": False}))
    lanes.load_state_dict(periln.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(lanes(idx).logits, periln(idx).logits, atol=2e-4, rtol=1e-4)
    read_out = Transformer(TransformerConfig(**common, residual="nag_inertial"))
    read_out.load_state_dict(periln.state_dict())
    assert not torch.allclose(read_out(idx).logits, periln(idx).logits)
    with pytest.raises(ValueError, match="tangential must be true or false"):
        build_residual("nag_inertial", D, n_sublayers=N, tangential="yes")


def test_the_inertial_write_slows_a_heavy_token_and_its_tangential_form_only_turns():
    strategy = build_residual("nag_inertial", D, n_sublayers=N)
    (u, rho), f = state_and_update(strategy)
    angles = [strategy.write((u, rho + shift), f, None, 0)[1] for shift in (0.0, 1.0, 2.0)]
    assert (angles[0] > angles[1]).all() and (angles[1] > angles[2]).all()
    along = 5.0 * u  # an update along the state turns nothing and makes the token heavier
    (u_new, rho_new), theta = strategy.write((u, rho), along, None, 0)
    torch.testing.assert_close(u_new, u, atol=1e-5, rtol=0)
    assert (rho_new > rho).all() and theta.abs().max() < 1e-3
    tangential = build_residual("nag_inertial", D, n_sublayers=N, tangential=True)
    (u_t, rho_t), theta_t = tangential.write((u, rho), f, None, 0)
    expected = rho - torch.log(torch.cos(theta_t))  # the norm grows only by the turn
    torch.testing.assert_close(rho_t, expected, atol=1e-5, rtol=0)
