"""The two kinds of part NAG's write is built from, their registries, and the settings each keeps.

An angle (`ANGLES`: gate, magnitude, additive, ...) decides how far a write turns a token and
performs the write; a bound (`BOUNDS`: decaying, flat, learned) says how far sublayer l may turn
it. Each part is an `nn.Module` with its own parameters and its own settings, which it checks and
saves in the state dict (`Part.get_extra_state`), so a checkpoint loads with the settings it was
trained under even after a default changes. Adding a family is one class with its decorator.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from nag_lightning.inputs import shorten
from nag_lightning.registry import Registry


class Part(nn.Module):
    """A part of NAG's write with settings of its own.

    Subclasses list their saved settings in `SETTINGS`, resolve them in the constructor (None
    there means the default) and say in `check` what values they cannot run with.
    """

    SETTINGS: tuple[str, ...] = ()
    """Settings saved in the state dict."""
    OBJECTIVE: tuple[str, ...] = ()
    """Settings of the training objective, not of the function the weights compute: a value given
    to the model (to go on training under another) wins over the checkpoint's."""

    def __init__(self) -> None:
        super().__init__()
        self._given: set[str] = set()

    def settle(self, given: dict[str, Any], defaults: dict[str, Any]) -> None:
        """Set the settings from the values `given` (None: not given) over `defaults`, checked."""
        self._given = {name for name, value in given.items() if value is not None}
        settings = {name: defaults[name] if given.get(name) is None else given[name]
                    for name in self.SETTINGS}
        self.check(settings)
        for name, value in settings.items():
            setattr(self, name, value)

    def check(self, settings: dict[str, Any]) -> None:
        """One sentence for settings this part cannot run with (given, or read from a checkpoint,
        where they may be any value)."""

    @property
    def name(self) -> str:
        """The registered name of this part."""
        return type(self).registry_name

    @property
    def has_parameters(self) -> bool:
        return any(True for _ in self.parameters())

    def get_extra_state(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.SETTINGS}

    def set_extra_state(self, state: Any) -> None:
        if not isinstance(state, dict):
            # torch.distributed.checkpoint's placeholder for an extra state it does not load: the
            # settings stay the ones this part was built with, from the same run
            return
        refuse_unknown(state, self.SETTINGS, f"NAG {self.name!r}")
        for name, value in state.items():
            if name in self._given and name not in self.OBJECTIVE and value != getattr(self, name):
                raise disagreement(name, value, getattr(self, name))
        kept = {name for name in self.OBJECTIVE if name in self._given}
        settings = {name: getattr(self, name) if name in kept else state.get(name, getattr(self, name))
                    for name in self.SETTINGS}
        self.check(settings)
        for name, value in settings.items():
            setattr(self, name, value)


ANGLES: Registry[Part] = Registry("NAG angle", "nag_lightning.nag_angles")
BOUNDS: Registry[Part] = Registry("NAG bound", "nag_lightning.nag_bounds")


def registered(registry: Registry, name: object, option: str) -> type[Part]:
    """The part registered as `name`: a short name only, never a class path, since a checkpoint's
    saved settings name parts too and must import nothing."""
    if not isinstance(name, str) or name not in registry.names():
        raise ValueError(f"{option} must be one of {tuple(registry.names())}; got {shorten(repr(name))}.")
    return registry.get(name)


def refuse_unknown(state: dict, settings: tuple[str, ...], what: str) -> None:
    """One sentence for a checkpoint's saved settings of `what` that name a setting it does not take."""
    unknown = sorted(set(state) - set(settings), key=str)
    if unknown:
        raise ValueError(f"The checkpoint's {what} has settings {shorten(unknown)} it does not take; it "
                         f"takes: {', '.join(settings) or 'none'}.")


def disagreement(name: str, saved: object, given: object) -> ValueError:
    """The sentence for a setting given to the model that the checkpoint was trained without."""
    return ValueError(f"The checkpoint was trained with {name}={shorten(saved)}; this model was given "
                      f"{name}={shorten(given)}: drop the option or give the checkpoint's value.")


def number(value: object) -> bool:
    """Whether `value` is a finite int or float (YAML's true is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}; got {shorten(repr(value))}.")


def check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false; got {shorten(repr(value))}.")
