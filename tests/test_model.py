"""The Transformer and the plugin registries, parametrized over every registered residual strategy."""

from __future__ import annotations

import pytest
import torch

import nag_lightning.registry as registry_module
from nag_lightning import RESIDUALS, ROUTERS, Transformer, TransformerConfig
from nag_lightning.registry import Registry
from nag_lightning.residuals import ResidualStrategy
from nag_lightning.residuals.prenorm import PreNormResidual


def tiny(residual="nag", **overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(d_model=32, n_layers=3, n_heads=4, seq_len=24, residual=residual)
    return Transformer(TransformerConfig(**{**cfg, **overrides}))


@pytest.mark.parametrize("residual", RESIDUALS.names())
def test_forward_backward_without_nan(residual):
    model = tiny(residual)
    idx = torch.randint(0, 256, (2, 24))
    out = model(idx)
    assert out.logits.shape == (2, 24, 256)
    loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), idx.roll(-1, 1).flatten())
    loss.backward()
    assert torch.isfinite(loss)
    for name, param in model.named_parameters():
        # A strategy may hold parameters the loss does not see in some settings (NAG's beta moves
        # only the norm lane, which reaches the logits only with norm_lane_readout).
        if name.startswith("strategy.") and param.grad is None:
            continue
        assert param.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(param.grad).all(), f"{name} has a non-finite gradient"


def test_nag_norm_lane_reaches_the_loss_only_through_the_readout():
    for readout in (False, True):
        model = tiny("nag", residual_options={"norm_lane_readout": readout, "beta_init": 0.1})
        model(torch.randint(0, 256, (2, 8))).logits.square().mean().backward()
        grad = model.strategy.beta.grad
        reaches = grad is not None and bool(grad.abs().sum() > 0)
        assert reaches == readout


@pytest.mark.parametrize("residual", RESIDUALS.names())
def test_causality(residual):
    model = tiny(residual).eval()
    idx = torch.randint(0, 256, (2, 24))
    changed = idx.clone()
    t = 10
    changed[:, t + 1 :] = torch.randint(0, 256, (2, 24 - t - 1))
    with torch.no_grad():
        a, b = model(idx).logits, model(changed).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-5, rtol=0)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # the change is visible after t


def test_depth_diagnostics_are_recorded_on_request():
    model = tiny("prenorm")
    model(torch.randint(0, 256, (2, 8)))
    assert all(s.contribution is None for s in model.sublayers)
    model.record_diagnostics(True)
    model(torch.randint(0, 256, (2, 8)))
    for sublayer in model.sublayers:
        assert sublayer.contribution.shape == (2, 8) and sublayer.state_norm.shape == (2, 8)
        assert (sublayer.contribution >= 0).all()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"d_model": 30, "n_heads": 4}, "must be divisible by model.arch.n_heads"),
        ({"seq_len": 1}, "seq_len must be at least 2"),
        ({"route_kinds": ["attn", "ffn"]}, "sublayer kinds \\['ffn'\\] that do not exist"),
        ({"route_layers": [7]}, "route_layers must be"),
        ({"residual": "no-such-strategy"},
         "Unknown residual strategy 'no-such-strategy'; registered: .*nag, .*prenorm"),
        ({"router": "no-such-router"}, "Unknown router 'no-such-router'; registered: .*none"),
    ],
)
def test_bad_config_says_what_to_fix(overrides, message, no_plugins):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_input_longer_than_seq_len_is_refused():
    with pytest.raises(ValueError, match="more than model.arch.seq_len = 24"):
        tiny()(torch.zeros(1, 25, dtype=torch.long))


def test_registry_refuses_duplicates_and_resolves_class_paths():
    with pytest.raises(ValueError, match="already registered"):
        RESIDUALS.register("prenorm")(type("Other", (ResidualStrategy,), {}))
    path = "nag_lightning.residuals.prenorm.PreNormResidual"
    assert RESIDUALS.get(path) is PreNormResidual
    cls, options = RESIDUALS.resolve({"class_path": path, "init_args": {"eps": 1e-5}})
    assert cls is PreNormResidual and options == {"eps": 1e-5}
    model = tiny(path, residual_options={"eps": 1e-5})
    assert isinstance(model.strategy, PreNormResidual) and model.strategy.eps == 1e-5
    with pytest.raises(ValueError, match="Cannot import the residual strategy class"):
        RESIDUALS.get("nag_lightning.residuals.nope.Missing")
    with pytest.raises(ValueError, match="takes only 'class_path' and 'init_args'"):
        RESIDUALS.resolve({"class_path": path, "eps": 1})
    assert "none" in ROUTERS.names()


def test_registry_loads_entry_point_plugins(monkeypatch):
    class FakeEntryPoint:
        name, value, dist = "fake", "nag_lightning.residuals.prenorm:PreNormResidual", None

        def load(self):
            return PreNormResidual

    seen = {}

    def fake_entry_points(group):
        seen["group"] = group
        return [FakeEntryPoint()]

    monkeypatch.setattr(registry_module, "entry_points", fake_entry_points)
    registry = Registry("residual strategy", "nag_lightning.residuals")
    assert registry.get("fake") is PreNormResidual
    assert seen["group"] == "nag_lightning.residuals"


class PluginEntryPoint:
    """An entry point of an installed distribution, as importlib.metadata gives it."""

    def __init__(self, name: str, value: str, load) -> None:
        self.name, self.value, self._load = name, value, load
        self.dist = type("Distribution", (), {"name": "nag-plugins-example"})()

    def load(self):
        return self._load()


def test_a_plugin_that_takes_a_built_in_name_is_refused_only_when_used(monkeypatch):
    class Imposter(PreNormResidual):
        pass

    plugins = [PluginEntryPoint("nag", "example.imposter:Imposter", lambda: Imposter)]
    monkeypatch.setattr(registry_module, "entry_points", lambda group: plugins)
    registry = Registry("residual strategy", "nag_lightning.residuals")
    registry.register("nag")(ResidualStrategy)
    registry.register("prenorm")(PreNormResidual)
    assert registry.get("prenorm") is PreNormResidual  # every other name still works
    with pytest.raises(ValueError, match=r"name 'nag' is taken twice: .* the package 'nag-plugins-example'"):
        registry.get("nag")
    assert registry.names() == ["nag", "prenorm"]


def test_a_plugin_that_fails_to_import_names_its_package_and_breaks_nothing_else(monkeypatch):
    def broken():
        raise ImportError("No module named 'example_dependency'")

    plugins = [PluginEntryPoint("mine", "example.mine:Mine", broken)]
    monkeypatch.setattr(registry_module, "entry_points", lambda group: plugins)
    registry = Registry("router", "nag_lightning.routers")
    registry.register("none")(ResidualStrategy)
    assert registry.get("none") is ResidualStrategy
    with pytest.raises(ValueError, match=r"'mine' of the package 'nag-plugins-example' failed to import"):
        registry.get("mine")


def test_a_class_path_to_a_file_in_the_working_directory_needs_no_pythonpath(tmp_path, monkeypatch):
    import sys

    (tmp_path / "my_residual_plugin.py").write_text(
        "from nag_lightning.residuals.prenorm import PreNormResidual\n\n\n"
        "class MyResidual(PreNormResidual):\n    pass\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_residual_plugin", raising=False)
    model = tiny("my_residual_plugin.MyResidual")
    assert type(model.strategy).__name__ == "MyResidual"
    sys.modules.pop("my_residual_plugin", None)


def test_default_init_is_width_aware():
    """Linear weights start at std 1/sqrt(d_model) unless init_std is given (output projections
    scaled down by 1/sqrt(2 n_layers)); GPT-2's 0.02 stays available."""
    for d_model in (64, 256):
        model = Transformer(TransformerConfig(d_model=d_model, n_layers=2, n_heads=4))
        qkv = model.blocks[0].attn.compute.qkv.weight
        assert abs(qkv.std().item() * d_model**0.5 - 1) < 0.05
        proj = model.blocks[1].mlp.compute.proj.weight
        assert abs(proj.std().item() * (d_model * model.cfg.n_sublayers) ** 0.5 - 1) < 0.05
    given = Transformer(TransformerConfig(d_model=64, n_layers=2, n_heads=4, init_std=0.02))
    assert abs(given.blocks[0].attn.compute.qkv.weight.std().item() / 0.02 - 1) < 0.05
    with pytest.raises(ValueError, match="init_std must be positive"):
        TransformerConfig(init_std=0.0)
