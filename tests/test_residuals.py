"""The residual strategies' invariants (DESIGN section 2) and their contribution angles (section 3)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from nag_lightning.checkpoints.compat import upgrade_nag_state
from nag_lightning.residuals import RESIDUALS, build_residual

D = 64
ROWS = 16


def nag(**options):
    return build_residual("nag", D, n_sublayers=8, **options)


def through_the_reader(state: dict, **options):
    """A NAG loaded as the checkpoint reader loads one: `state` upgraded by `compat` with the
    checkpoint's residual `options`, the strategy built from the options it leaves."""
    state = dict(state)
    upgraded = upgrade_nag_state(state, options, prefix="")
    strategy = nag(**(options if upgraded is None else upgraded))
    strategy.load_state_dict(state)
    return strategy


def flat_settings(strategy) -> dict:
    """The state dict of a NAG `strategy` as releases before the parts saved it: one flat dict of
    settings, the gate's parameters on the residual."""
    state = dict(strategy.state_dict())
    angle, bound = state.pop("angle._extra_state"), state.pop("bound._extra_state")
    residual = state.pop("_extra_state")
    settings = {"theta_max": bound["theta_max"], "norm_lane_readout": residual["norm_lane_readout"],
                "angle": residual["angle"]}
    settings.update({"bound": angle.pop("saturation")} if "saturation" in angle else angle)
    state["_extra_state"] = settings
    return {k.removeprefix("angle."): v for k, v in state.items()}


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
    strategy = nag(angle="magnitude", alpha_init=2.0)
    u, rho = unit_state(strategy)
    for scale in (0.1, 1.0, 100.0):
        f = scale * sublayer_outputs(u)["random"]
        (u_new, _), theta = strategy.write((u, rho), f, None, index=0)
        applied = torch.acos((u * u_new).sum(-1).clamp(-1, 1))
        torch.testing.assert_close(applied, theta, atol=1e-3, rtol=0)
        assert (theta <= strategy.bound.theta_max).all()
    # A huge update is bounded near theta_max, not wrapped around.
    assert theta.min() > 0.99 * strategy.bound.theta_max


def test_nag_theta_does_not_depend_on_rho():
    strategy = nag(beta_init=0.5)
    u, rho = unit_state(strategy)
    f = sublayer_outputs(u)["random"]
    gate = torch.rand(ROWS)
    (u_a, _), theta_a = strategy.write((u, rho), f, gate, index=1)
    (u_b, rho_b), theta_b = strategy.write((u, rho + 10.0 * torch.randn(ROWS)), f, gate, index=1)
    assert torch.equal(theta_a, theta_b) and torch.equal(u_a, u_b)


def test_nag_rho_moves_with_the_radial_part():
    """By beta * a / sqrt(d), times theta / theta_max with gate_radial (the gate starts at half the
    bound)."""
    u, rho = unit_state(nag())
    for options, share in (({}, 1.0), ({"gate_radial": True}, 0.5), ({"angle": "magnitude"}, 1.0)):
        (_, rho_new), _ = nag(beta_init=0.5, **options).write((u, rho), 2.0 * u, None, index=0)
        torch.testing.assert_close(rho_new, rho + share * 0.5 * 2.0 / math.sqrt(D))


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
    assert strategy.angle.name == "gate" and strategy.bound.theta_max == 8 / 8 and strategy.norm_lane_readout
    magnitude = nag(angle="magnitude")
    assert magnitude.bound.theta_max == 4 / 8 and magnitude.angle.saturation == "tanh"
    assert not any("gate" in name for name, _ in magnitude.named_parameters())


def test_nag_checkpoint_carries_its_settings():
    """A state dict loads with the settings it was trained under, whatever the new model's."""
    trained = nag(angle="magnitude", theta_max=0.3, norm_lane_readout=False, saturation="rational")
    loaded = nag(angle="magnitude")
    loaded.load_state_dict(trained.state_dict())
    assert (loaded.bound.theta_max, loaded.norm_lane_readout, loaded.angle.saturation) == (0.3, False, "rational")
    with pytest.raises(ValueError, match="trained with theta_max=0.3; this model was given theta_max=0.5"):
        nag(angle="magnitude", theta_max=0.5).load_state_dict(trained.state_dict())


def test_nag_checkpoint_without_settings_gets_the_defaults_of_its_time():
    """State dicts from before the settings were saved: theta_max 2/N and no readout, unless given."""
    old = {k: v for k, v in nag(angle="magnitude").state_dict().items() if not k.endswith("_extra_state")}
    loaded = through_the_reader(old)
    assert (loaded.bound.theta_max, loaded.norm_lane_readout, loaded.angle.name) == (2 / 8, False, "magnitude")
    given = through_the_reader(old, theta_max=1.0, norm_lane_readout=True)
    assert (given.bound.theta_max, given.norm_lane_readout) == (1.0, True)
    prenorm = build_residual("prenorm", D, n_sublayers=8).state_dict()
    assert upgrade_nag_state(prenorm, {}, prefix="") is None
    assert "_extra_state" not in prenorm  # another strategy's state is left alone


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


def test_lns_scales_each_read_by_its_blocks_inverse_square_root():
    """Block l (1-based) reads RMSNorm(x)·γ/sqrt(l); both sublayers of a block share l, and the
    first block reads exactly what pre-norm reads."""
    lns, prenorm = build_residual("lns", D, n_sublayers=6), build_residual("prenorm", D, n_sublayers=6)
    state = (torch.randn(ROWS, D) * 4.0,)
    for index, block in ((0, 1), (1, 1), (2, 2), (3, 2), (5, 3)):
        expected = prenorm.read(state, index) / math.sqrt(block)
        torch.testing.assert_close(lns.read(state, index), expected, rtol=0, atol=0)
    f, gate = torch.randn(ROWS, D), torch.rand(ROWS)
    (x_new,), angle = lns.write(state, f, gate, 2)
    (x_pre,), angle_pre = prenorm.write(state, f, gate, 2)
    assert torch.equal(x_new, x_pre) and torch.equal(angle, angle_pre)  # pre-norm's stream


def test_periln_update_has_the_rms_of_its_output_gain():
    strategy = build_residual("periln", D, n_sublayers=4)
    with torch.no_grad():
        strategy.gamma_post[1] = 2.5
    e = torch.randn(ROWS, D) * 7.0
    (x,) = strategy.init_state(e)
    rms = lambda t: t.pow(2).mean(-1).sqrt()  # noqa: E731
    torch.testing.assert_close(rms(x), torch.ones(ROWS), atol=1e-4, rtol=0)  # embedding normalized
    for scale in (0.1, 1.0, 1e3):  # well above the norm's epsilon
        (x_new,), _ = strategy.write((x,), scale * torch.randn(ROWS, D), None, 1)
        torch.testing.assert_close(rms(x_new - x), torch.full((ROWS,), 2.5), atol=1e-3, rtol=0)
    gate = torch.rand(ROWS)
    (x_new,), _ = strategy.write((x,), torch.randn(ROWS, D), gate, 1)
    torch.testing.assert_close(rms(x_new - x), 2.5 * gate, atol=1e-3, rtol=0)


def test_periln_tangential_turns_the_stream_without_growing_it_radially():
    full = build_residual("periln", D, n_sublayers=4)
    ablated = build_residual("periln", D, n_sublayers=4, tangential=True)
    (x,) = ablated.init_state(torch.randn(ROWS, D) * 3.0)
    f = torch.randn(ROWS, D) + 2.0 * x  # an update with a large part along the stream
    (x_new,), angle = ablated.write((x,), f, None, 1)
    step = x_new - x
    torch.testing.assert_close((step * x).sum(-1), torch.zeros(ROWS), atol=1e-3, rtol=0)  # no radial part
    norm = lambda t: t.norm(dim=-1)  # noqa: E731
    torch.testing.assert_close(norm(x_new) ** 2, norm(x) ** 2 + norm(step) ** 2, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(angle, torch.atan2(norm(step), norm(x)), rtol=1e-4, atol=1e-5)
    (x_full,), _ = full.write((x,), f, None, 1)
    assert not torch.allclose(x_full, x_new)  # the full Peri-LN write does have a radial part
    with pytest.raises(ValueError, match="tangential must be true or false"):
        build_residual("periln", D, n_sublayers=4, tangential="yes")


@pytest.mark.parametrize("name", ["prenorm", "lns", "periln", "ngpt"])
def test_contribution_is_the_angle_between_states_before_and_after(name):
    strategy = build_residual(name, D, n_sublayers=4)
    state = strategy.init_state(torch.randn(ROWS, D) * 2.0)
    (x,) = state
    gate = torch.rand(ROWS)
    (x_new,), angle = strategy.write(state, torch.randn(ROWS, D) * 3.0, gate, 1)
    expected = torch.acos(torch.nn.functional.cosine_similarity(x, x_new, dim=-1).clamp(-1, 1))
    torch.testing.assert_close(angle, expected, atol=1e-3, rtol=0)
    assert (angle > 0).all()


def test_ngpt_state_stays_on_the_unit_sphere():
    strategy = build_residual("ngpt", D, n_sublayers=8)
    (x,) = strategy.init_state(torch.randn(ROWS, D) * 5.0)
    torch.testing.assert_close(x.norm(dim=-1), torch.ones(ROWS))
    for index, f in enumerate(sublayer_outputs(x).values()):
        for dtype in (torch.float32, torch.bfloat16):
            (x,), _ = strategy.write((x,), f.to(dtype), torch.rand(ROWS), index)
            assert x.dtype == torch.float32
            torch.testing.assert_close(x.norm(dim=-1), torch.ones(ROWS), atol=2e-6, rtol=0)
    features, scale = strategy.final((x,))
    assert torch.equal(features, x) and scale.shape == (ROWS, 1)
    torch.testing.assert_close(strategy.state_norm((x,)), torch.ones(ROWS))


def test_ngpt_eigen_learning_rates_and_logit_scale_use_the_papers_scaling_trick():
    """Stored at 1/sqrt(d), effective 0.05 (alpha) and 1 (s_z): a step of f exactly along the
    state's orthogonal complement turns it by atan(0.05 / 0.95)."""
    strategy = build_residual("ngpt", D, n_sublayers=4)
    assert torch.allclose(strategy.alpha, torch.full((4, D), 1 / math.sqrt(D)))
    assert torch.allclose(strategy.logit_scale, torch.tensor(1 / math.sqrt(D)))
    x = torch.zeros(1, D)
    x[0, 0] = 1.0
    f = torch.zeros(1, D)
    f[0, 1] = 9.0
    (_,), angle = strategy.write((x,), f, None, 0)
    torch.testing.assert_close(angle, torch.atan(torch.tensor([0.05 / 0.95])))
    torch.testing.assert_close(strategy.final((x,))[1], torch.ones(1, 1))


def test_ngpt_projects_every_matrix_to_unit_norm_along_the_embedding_axis():
    from nag_lightning.model import Transformer, TransformerConfig

    model = Transformer(TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, residual="ngpt"))
    model.strategy.project_weights(model)
    ones = lambda n: torch.ones(n)  # noqa: E731
    torch.testing.assert_close(model.embed.weight.norm(dim=1), ones(256))
    torch.testing.assert_close(model.head.weight.norm(dim=1), ones(256))
    for block in model.blocks:
        torch.testing.assert_close(block.attn.compute.qkv.weight.norm(dim=1), ones(96))
        torch.testing.assert_close(block.attn.compute.proj.weight.norm(dim=0), ones(32))
        torch.testing.assert_close(block.mlp.compute.gate_up.weight.norm(dim=1), ones(256))
        torch.testing.assert_close(block.mlp.compute.proj.weight.norm(dim=0), ones(128))
    alpha = model.strategy.alpha.clone()
    model.strategy.project_weights(model)  # the strategy's own parameters are not touched
    assert torch.equal(model.strategy.alpha, alpha)
    # Other strategies leave the weights alone.
    prenorm = Transformer(
        TransformerConfig(d_model=32, n_layers=1, n_heads=2, seq_len=16, residual="prenorm"))
    before = prenorm.head.weight.clone()
    prenorm.strategy.project_weights(prenorm)
    assert torch.equal(prenorm.head.weight, before)


def test_training_adds_the_callbacks_each_strategys_method_needs():
    """nGPT's weight projection; the run's length for NAG's CPU write; nothing for the others."""
    from nag_lightning.callbacks import RunLength, WeightProjection
    from nag_lightning.model import TransformerConfig
    from nag_lightning.training.module import LanguageModel

    def tiny(residual: str) -> TransformerConfig:
        return TransformerConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8, residual=residual)

    callbacks = LanguageModel(tiny("ngpt")).configure_callbacks()
    assert [type(c) for c in callbacks] == [WeightProjection]
    assert [type(c) for c in LanguageModel(tiny("nag")).configure_callbacks()] == [RunLength]
    for name in ("prenorm", "lns", "periln"):
        assert LanguageModel(tiny(name)).configure_callbacks() == []


def gated_nag(**options):
    strategy = nag(angle="gate", **options)
    with torch.no_grad():  # a trained gate: the angle differs from token to token
        strategy.angle.gate_w.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(2))
    return strategy


def test_gated_nag_angle_comes_from_the_gate_not_the_update_size():
    strategy = gated_nag()
    assert strategy.bound.theta_max == 8 / 8  # its default bound: 8 / n_sublayers
    u, rho = unit_state(strategy)
    thetas = []
    for scale in (0.1, 1.0, 100.0):
        f = scale * sublayer_outputs(u)["random"]
        (u_new, _), theta = strategy.write((u, rho), f, None, index=2)
        torch.testing.assert_close(u_new.norm(dim=-1), torch.ones(ROWS), atol=2e-6, rtol=0)
        applied = torch.acos((u * u_new).sum(-1).clamp(-1, 1))
        torch.testing.assert_close(applied, theta, atol=1e-3, rtol=0)
        thetas.append(theta)
    assert torch.equal(thetas[0], thetas[1]) and torch.equal(thetas[1], thetas[2])  # size-blind
    assert (thetas[0] < strategy.bound.of(2)).all()
    assert thetas[0].min() < 0.7 * thetas[0].max()  # tells tokens apart
    gate = strategy.angle
    assert gate.gain == 1.0  # the default gate_gain: the gate learns slowly
    score = gate.gain * (u @ gate.gate_w[2]) + gate.gate_b[2]
    torch.testing.assert_close(thetas[0], strategy.bound.of(2) * torch.sigmoid(score).detach())


def test_gated_nag_gate_zero_is_identity_and_options_are_checked():
    strategy = gated_nag(beta_init=0.7)
    u, rho = unit_state(strategy)
    (u_new, rho_new), angle = strategy.write((u, rho), sublayer_outputs(u)["random"], torch.zeros(ROWS), 1)
    assert torch.equal(u_new, u) and torch.equal(rho_new, rho) and torch.equal(angle, torch.zeros(ROWS))
    with pytest.raises(ValueError, match="angle must be one of"):
        nag(angle="size")
    with pytest.raises(ValueError, match="angle must be one of"):  # a part is named, never imported
        nag(angle="os.path.join")


def test_gated_nag_checkpoint_carries_its_angle():
    trained = gated_nag(gate_bias=-1.0)
    loaded = nag(angle="gate")
    loaded.load_state_dict(trained.state_dict())
    assert loaded.angle.name == "gate" and torch.equal(loaded.angle.gate_b, trained.angle.gate_b)
    assert nag().get_extra_state()["angle"] == "gate"
    magnitude_state = nag(angle="magnitude").get_extra_state()
    with pytest.raises(ValueError, match="trained with angle=magnitude; this model was given angle=gate"):
        gate_only = {k: v for k, v in nag(angle="gate").state_dict().items() if k != "_extra_state"}
        nag(angle="gate").load_state_dict({**gate_only, "_extra_state": magnitude_state})


def test_a_magnitude_checkpoint_loads_into_a_model_built_with_the_defaults():
    """Checkpoints of the magnitude angle whose options leave the angle to the default: the reader
    names it, so the model is built without the gate and writes exactly as the trained one; a
    model given angle='gate', or built with it, refuses it."""
    trained = nag(angle="magnitude", beta_init=0.4)
    loaded = through_the_reader(flat_settings(trained))
    assert loaded.angle.name == "magnitude" and loaded.bound.theta_max == 4 / 8
    assert not any("gate" in name for name, _ in loaded.named_parameters())
    u, rho = unit_state(loaded)
    f = sublayer_outputs(u)["random"]
    for a, b in zip(loaded.write((u, rho), f, None, 2), trained.write((u, rho), f, None, 2)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="trained with angle=magnitude; this model was given angle=gate"):
        nag(angle="gate").load_state_dict(trained.state_dict())
    with pytest.raises(ValueError, match="built with angle=gate: give residual_options angle=magnitude"):
        nag().load_state_dict(trained.state_dict())


def test_gated_write_runs_the_triton_kernel_as_the_reference():
    """The default angle takes the fused kernel too (under the interpreter on CPU)."""
    from nag_kernels.nag_write import interpreter_active

    if not interpreter_active() and not torch.cuda.is_available():
        pytest.skip("needs triton with CUDA or TRITON_INTERPRET=1")
    device = "cuda" if torch.cuda.is_available() and not interpreter_active() else "cpu"
    torch_write, triton_write = gated_nag(beta_init=0.3), gated_nag(beta_init=0.3, kernel="triton")
    triton_write.load_state_dict(torch_write.state_dict())
    triton_write.to(device)
    u, rho = unit_state(torch_write)
    f = sublayer_outputs(u)["random"].requires_grad_()
    gate = torch.rand(ROWS)
    outs = []
    for strategy, dev in ((torch_write, "cpu"), (triton_write, device)):
        ff = f.detach().to(dev).requires_grad_()
        (u_new, rho_new), theta = strategy.write((u.to(dev), rho.to(dev)), ff, gate.to(dev), 2)
        (u_new.sum(-1) * torch.arange(ROWS, device=dev) + rho_new).sum().backward()
        outs.append((u_new.cpu(), rho_new.cpu(), theta.cpu(), ff.grad.cpu(), strategy.angle.gate_w.grad.cpu()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)
    assert outs[0][4].abs().max() > 0  # the gate learns through the write


def test_angle_cost_prices_the_gated_angle_in_training_only():
    """aux_loss is angle_cost times the mean share of the bound turned, over all sublayers; its
    gradient lowers every gate; nothing is priced in eval, without a cost, or for magnitude."""
    strategy = gated_nag(angle_cost=0.5)
    state = unit_state(strategy)
    shares = []
    for index in range(strategy.n_sublayers):
        f = sublayer_outputs(state[0])["random"]
        shares.append(strategy.planned_angle(state, index).mean() / strategy.bound.of(index))
        state, _ = strategy.write(state, f, None, index)
    torch.testing.assert_close(strategy.aux_loss(), 0.5 * torch.stack(shares).mean())
    strategy.aux_loss().backward()
    assert (strategy.angle.gate_b.grad > 0).all()  # descending it shrinks every sublayer's angle
    unit_state(strategy)  # a new pass starts a new price
    assert strategy.aux_loss() is None
    strategy.eval()
    state = unit_state(strategy)
    strategy.write(state, sublayer_outputs(state[0])["random"], None, 0)
    assert strategy.aux_loss() is None
    free = gated_nag(angle_cost=0).train()
    state = unit_state(free)
    free.write(state, sublayer_outputs(state[0])["random"], None, 0)
    assert free.aux_loss() is None
    with pytest.raises(ValueError, match="angle_cost must be a number >= 0"):
        nag(angle_cost=-0.1)
    with pytest.raises(ValueError, match="'angle_cost', which the NAG angle 'magnitude' does not take"):
        nag(angle_cost=0.1, angle="magnitude")


def test_angle_cost_reaches_the_training_loss():
    """The model adds the strategy's price to the auxiliary loss the training step adds."""
    from nag_lightning.model import Transformer, TransformerConfig

    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = {}
    for cost in (0.0, 0.2):
        torch.manual_seed(0)
        model = Transformer(TransformerConfig(d_model=32, n_layers=2, seq_len=16,
                                              residual_options={"angle_cost": cost}))
        losses[cost] = model(idx).aux_loss
        assert model.eval()(idx).aux_loss == 0
    assert losses[0.0] == 0
    torch.testing.assert_close(losses[0.2], torch.tensor(0.2 * 0.5))  # every gate starts at half the bound


def test_angle_cost_travels_in_checkpoints_and_a_given_one_wins():
    """A checkpoint loads with the price it was trained under; one saved before the option was
    (no key) was trained without; a price given to the model is kept, to train on under it."""
    priced = gated_nag(angle_cost=0.25)
    assert priced.angle.get_extra_state()["angle_cost"] == 0.25
    loaded = nag()
    loaded.load_state_dict(priced.state_dict())
    assert loaded.angle.angle_cost == 0.25
    before = flat_settings(priced)
    del before["_extra_state"]["angle_cost"]
    old = through_the_reader(before)
    assert old.angle.angle_cost == 0.0
    retuned = nag(angle_cost=0.05)
    retuned.load_state_dict(priced.state_dict())
    assert retuned.angle.angle_cost == 0.05
    with pytest.raises(ValueError, match="'angle_cost', which the NAG angle 'magnitude' does not take"):
        through_the_reader(flat_settings(nag(angle="magnitude")), angle_cost=0.1)


def test_gate_radial_scales_the_radial_update_by_the_gates_share_of_the_bound():
    """With gate_radial the log-norm moves by theta / theta_max of the free write's radial update
    (the direction is the same), so a token the gate barely turns keeps its norm; gate 0 is still
    the identity."""
    free, tied = gated_nag(beta_init=0.7), gated_nag(beta_init=0.7, gate_radial=True)
    u, rho = unit_state(free)
    f = sublayer_outputs(u)["random"]
    (u_free, rho_free), theta = free.write((u, rho), f, None, 3)
    (u_tied, rho_tied), theta_tied = tied.write((u, rho), f, None, 3)
    assert torch.equal(theta, theta_tied)
    torch.testing.assert_close(u_tied, u_free, atol=0, rtol=0)
    torch.testing.assert_close(rho_tied - rho, (rho_free - rho) * theta / tied.bound.of(3))
    (u0, rho0), _ = tied.write((u, rho), f, torch.zeros(ROWS), 3)
    assert torch.equal(u0, u) and torch.equal(rho0, rho)
    assert tied.angle.get_extra_state()["gate_radial"] is True
    with pytest.raises(ValueError, match="'gate_radial', which the NAG angle 'magnitude' does not take"):
        nag(angle="magnitude", gate_radial=True)
    with pytest.raises(ValueError, match="gate_radial=True; this model was given gate_radial=False"):
        nag(gate_radial=False).load_state_dict(tied.state_dict())


def test_oracle_lanes_experiment_skips_only_the_direction(monkeypatch):
    """experiments/oracle_lanes.py: its oracle keeps the direction of the tokens below tau and
    writes their log-norm as the sublayer would."""
    from nag_lightning.model import Transformer, TransformerConfig

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "experiments"))
    from oracle_lanes import DirectionOnlyOracle

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=32, n_layers=1, seq_len=16,
                                          residual_options={"beta_init": 0.5}))
    sublayer, strategy = model.sublayers[0], model.strategy
    with torch.no_grad():  # a trained gate: the angle differs from token to token
        strategy.angle.gate_w.normal_(0.0, 0.3)
    state = strategy.init_state(model.embed(torch.randint(0, 256, (2, 16))))
    h = strategy.read(state, 0)
    (u_full, rho_full), angle = strategy.write(state, sublayer.compute(h), None, 0, True)
    tau = float(angle.median())
    u, rho = DirectionOnlyOracle(sublayer, tau)(state, strategy)
    kept = angle >= tau
    assert kept.any() and (~kept).any()
    torch.testing.assert_close(u[kept], u_full[kept])
    assert torch.equal(u[~kept], state[0][~kept])
    torch.testing.assert_close(rho, rho_full)
    assert not torch.equal(rho[~kept], state[1][~kept])  # the skipped tokens' radial update is written
