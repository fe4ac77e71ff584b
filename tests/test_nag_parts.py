"""NAG's parts: every registered angle and bound builds, writes, saves and reloads its settings;
each refuses bad settings of its own, given or saved, in one sentence."""

from __future__ import annotations

import math

import pytest
import torch

from nag_lightning.residuals import build_residual
from nag_lightning.residuals.nag import ANGLES, BOUNDS

D, N, ROWS = 16, 4, 6

BAD_SETTINGS = [  # (options, the part that refuses, its sentence)
    ({"theta_max": 0.0}, "bound", "theta_max must be in (0, pi] radians; got 0.0."),
    ({"theta_max": 4.0, "bound": "flat"}, "bound", "theta_max must be in (0, pi] radians; got 4.0."),
    ({"theta_max": "big", "bound": "learned"}, "bound", "theta_max must be in (0, pi] radians; got 'big'."),
    ({"gate_gain": -1.0}, "angle", "gate_gain must be a positive number or sqrt_d; got -1.0."),
    ({"gate_gain": "fast"}, "angle", "gate_gain must be a positive number or sqrt_d; got 'fast'."),
    ({"gate_radial": "yes"}, "angle", "gate_radial must be true or false; got 'yes'."),
    ({"angle_cost": math.nan}, "angle", "angle_cost must be a number >= 0; got nan."),
    ({"angle": "magnitude", "saturation": "cubic"}, "angle",
     "saturation must be one of ('tanh', 'rational'); got 'cubic'."),
    ({"angle": "additive", "inertia": "mass"}, "angle", "inertia must be one of ('none', 'norm', 'lane'); got 'mass'."),
]


def options_for(kind: str, name: str) -> dict:
    """Residual options that build part `name` of `kind` with everything else at its default."""
    if kind == "angle":
        return {"angle": name}
    return {"bound": name, "angle": "magnitude" if name == "flat" else "gate"}


PARTS = [("angle", name) for name in ANGLES.names()] + [("bound", name) for name in BOUNDS.names()]


@pytest.mark.parametrize(("kind", "name"), PARTS)
def test_every_part_writes_a_unit_direction_and_reloads_its_settings(kind, name):
    strategy = build_residual("nag", D, n_sublayers=N, **options_for(kind, name))
    part = getattr(strategy, kind)
    assert part.name == name
    g = torch.Generator().manual_seed(0)
    state = strategy.init_state(torch.randn(ROWS, D, generator=g))
    (u, rho), theta = strategy.write(state, torch.randn(ROWS, D, generator=g), None, 1)
    torch.testing.assert_close(u.norm(dim=-1), torch.ones(ROWS), atol=2e-6, rtol=0)
    assert torch.isfinite(rho).all() and (theta >= 0).all()
    saved = part.get_extra_state()
    assert set(saved) == set(part.SETTINGS)
    part.set_extra_state(dict(saved))
    assert part.get_extra_state() == saved


@pytest.mark.parametrize(("options", "kind", "sentence"), BAD_SETTINGS)
def test_a_part_refuses_its_own_bad_settings_given_or_saved(options, kind, sentence):
    with pytest.raises(ValueError) as given:
        build_residual("nag", D, n_sublayers=N, **options)
    assert str(given.value) == sentence
    good = {k: v for k, v in options.items() if k in ("angle", "bound")}
    part = getattr(build_residual("nag", D, n_sublayers=N, **good), kind)
    name, value = next((k, v) for k, v in options.items() if k not in ("angle", "bound"))
    with pytest.raises(ValueError) as saved:  # a checkpoint's settings may be any value
        part.set_extra_state({**part.get_extra_state(), name: value})
    assert str(saved.value) == sentence


def test_an_option_of_another_part_is_refused_by_name():
    with pytest.raises(ValueError, match="'saturation', which the NAG angle 'gate' does not take; it accepts: "
                                         "gate_gain, gate_bias, gate_radial, angle_cost"):
        build_residual("nag", D, n_sublayers=N, saturation="rational")
    with pytest.raises(ValueError, match="The checkpoint's NAG 'flat' has settings \\['gate_gain'\\] it does not take"):
        build_residual("nag", D, n_sublayers=N, bound="flat").bound.set_extra_state({"gate_gain": 1.0})
    with pytest.raises(ValueError, match="The additive angle turns within a bound of flat; got bound='learned'"):
        build_residual("nag", D, n_sublayers=N, angle="additive", bound="learned")
