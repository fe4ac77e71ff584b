"""The settings of the NAG write and the one check they pass, whether given to the constructor or
read from a checkpoint's saved state (`NAGResidual.set_extra_state`), where they may be any value."""

from __future__ import annotations

import math

from nag_kernels import BOUNDS
from nag_lightning.inputs import shorten

ANGLES = ("magnitude", "gate", "additive")
"""Where a sublayer's angle comes from: the size of its tangential output, bounded; a learned gate
on the token's direction; or the turn of a renormalised addition."""
GATE_READS = ("state", "update", "tangent")
"""What the gated angle's gate reads: the state, the state and the update, or the state, times the
update's tangential share."""
BOUND_SCHEDULES = ("flat", "decaying")
"""How the gated angle's bound varies with depth: the same everywhere, or falling like 1/sqrt(l)."""
INERTIA = ("none", "norm", "lane")
"""Whether the norm lane feeds back into the additive angle's step: not at all, as pre-norm's norm,
or as NAG's learned lane."""


def check_settings(theta_max: float, norm_lane_readout: bool, bound: str, angle: str, angle_cost: float,
                   gate_radial: bool, gate_reads: str = "state", learned_bound: bool = False,
                   channel_scale: bool = False, gate_gain: float | str = "sqrt_d",
                   inertia: str = "none", bound_schedule: str = "flat") -> None:
    """One sentence for settings of NAG it cannot run with, given to the constructor or read from a
    checkpoint's saved state (`NAGResidual.set_extra_state`), where they may be any value."""
    if angle not in ANGLES:
        raise ValueError(f"angle must be one of {ANGLES}; got {shorten(repr(angle))}.")
    if not _number(theta_max) or not 0 < theta_max <= math.pi:
        raise ValueError(f"theta_max must be in (0, pi] radians; got {shorten(repr(theta_max))}.")
    if bound not in BOUNDS:
        raise ValueError(f"bound must be one of {BOUNDS}; got {shorten(repr(bound))}.")
    priced = _number(angle_cost) and math.isfinite(angle_cost) and angle_cost >= 0
    if not priced or (angle_cost > 0 and angle != "gate"):
        raise ValueError(f"angle_cost must be >= 0 and prices the gated angle only; got "
                         f"{shorten(repr(angle_cost))} with angle={angle!r}: give angle: gate, or drop "
                         "angle_cost.")
    for name, value in (("norm_lane_readout", norm_lane_readout), ("gate_radial", gate_radial)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false; got {shorten(repr(value))}.")
    if gate_radial and angle != "gate":
        raise ValueError(f"gate_radial scales the radial update by the gated angle; got angle={angle!r}: "
                         "give angle: gate, or drop gate_radial.")
    if gate_reads not in GATE_READS:
        raise ValueError(f"gate_reads must be one of {GATE_READS}; got {shorten(repr(gate_reads))}.")
    for name, value in (("learned_bound", learned_bound), ("channel_scale", channel_scale)):
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false; got {shorten(repr(value))}.")
    if angle != "gate" and (gate_reads != "state" or learned_bound):
        raise ValueError(f"gate_reads and learned_bound shape the gated angle; got angle={angle!r}: "
                         "give angle: gate, or drop them.")
    if gate_gain != "sqrt_d" and not (_number(gate_gain) and math.isfinite(gate_gain) and gate_gain > 0):
        raise ValueError(f"gate_gain must be a positive number or sqrt_d; got "
                         f"{shorten(repr(gate_gain))}.")
    if inertia not in INERTIA:
        raise ValueError(f"inertia must be one of {INERTIA}; got {shorten(repr(inertia))}.")
    if bound_schedule not in BOUND_SCHEDULES:
        raise ValueError(f"bound_schedule must be one of {BOUND_SCHEDULES}; got "
                         f"{shorten(repr(bound_schedule))}.")
    if bound_schedule != "flat" and (angle != "gate" or learned_bound):
        raise ValueError("bound_schedule shapes the gated angle's fixed bound; give angle: gate without "
                         "learned_bound, or drop bound_schedule.")
    if inertia != "none" and angle != "additive":
        raise ValueError(f"inertia scales the additive angle's step by the state's norm; got "
                         f"angle={angle!r}: give angle: additive, or drop inertia.")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
