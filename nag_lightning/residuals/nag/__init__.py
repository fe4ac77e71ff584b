"""NAG, the norm-agnostic residual stream (`NAGResidual`), built from parts: an angle, how far a
write turns a token (`angle.py`; the gate in `gate.py`, the other families beside it), and a bound,
how far sublayer l may turn it (`bounds.py`). A new family is one part, registered with
`@ANGLES.register` or `@BOUNDS.register` in a module imported here."""

from nag_lightning.residuals.nag import additive, bounds, gate, gate_reads, magnitude  # noqa: F401  (register)
from nag_lightning.residuals.nag.angle import Angle
from nag_lightning.residuals.nag.bounds import Bound
from nag_lightning.residuals.nag.gate import GateAngle
from nag_lightning.residuals.nag.parts import ANGLES, BOUNDS, Part
from nag_lightning.residuals.nag.residual import NAG_OPTIONS, ChannelGain, NAGResidual

__all__ = ["ANGLES", "BOUNDS", "NAG_OPTIONS", "Angle", "Bound", "ChannelGain", "GateAngle", "NAGResidual",
           "Part"]
