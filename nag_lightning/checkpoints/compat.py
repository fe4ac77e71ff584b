"""Checkpoints and configs of earlier releases, brought to the current format before anything is built.

Like torchtitan's state-dict adapter, this is the one module that knows earlier formats: the model,
its plugins and the commands see only the current one. The checkpoint reader
(`nag_lightning.checkpoints.reader.read_saved`) passes every checkpoint it reads through
`upgrade_checkpoint`, so a run resumed, evaluated, swept or generated from reads the same, and
every reader of saved settings goes through `current_layout`. What earlier releases wrote:

- Hyper-parameters before `model.arch`: the architecture's fields flat among the training
  settings, a plugin as `{class_path, init_args}`, unset options as None (`current_layout`).
- NAG's state (`upgrade_nag_state`): before its settings travelled in the state dict, no
  `_extra_state` at all (those runs trained with theta_max 2/N and no norm-lane readout, unless
  their options said otherwise); before each later setting, no key for it (`NAG_BEFORE`). A
  checkpoint of the magnitude angle whose options do not name it (it was the default then) gets it
  named, so the model is built as it trained: without the gate.
- NAG before it was built from parts: one flat dict of settings, the gate's and the learned
  bound's parameters on the residual itself, and options that selected families by flags
  (`bound_schedule`, `learned_bound`, `gate_reads`, `bound` for the magnitude angle's
  saturation). Its settings are split among the residual, its angle and its bound, its parameters
  renamed into the parts that own them (`NAG_MOVED`), its options renamed (`current_nag_options`).
- Configs and command lines before `model.arch`: refused with one sentence that says how to
  write them now (`refuse_older_layout`).
- Modules that have moved since (`MOVED_MODULES`): the class paths that checkpoints, configs and
  run folders saved (`nag_lightning.module.NAGLanguageModel`, `nag_lightning.tokenizer.Tokenizer`,
  ...) resolve to where those classes live now, through one import alias that `import
  nag_lightning` installs (`install_moved_modules`). That is why this module imports torch and the
  model only where a function needs them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Mapping
from dataclasses import fields
from types import ModuleType
from typing import Any

ARCH = "arch"
PLUGIN_KINDS = ("residual", "router")
NAG_PREFIX = "model.strategy."
"""Where a `LanguageModel` checkpoint keeps the residual strategy's state."""

NAG_BEFORE = {"angle": "magnitude", "angle_cost": 0.0, "gate_radial": False, "gate_reads": "state",
              "learned_bound": False, "channel_scale": False, "gate_gain": "sqrt_d", "inertia": "none",
              "bound_schedule": "flat"}
"""What a NAG checkpoint saved before a setting existed trained with: its absence means this."""
NAG_MOVED = {"gate_w": "angle.gate_w", "gate_b": "angle.gate_b", "gate_v": "angle.gate_v",
             "bound_logit": "bound.logit", "channel_gain": "channel.gain"}
"""Where NAG's parameters of before the parts live now, below the strategy's prefix."""
NAG_ANGLE_SETTINGS = {"gate": ("gate_gain", "gate_radial", "angle_cost"), "magnitude": ("bound",),
                      "additive": ("inertia",)}
"""The settings of the flat dict each angle of then owns now (the magnitude's `bound` is now its
`saturation`)."""


def architecture_fields() -> list[str]:
    """The settings of `TransformerConfig`, in declaration order."""
    from nag_lightning.model import TransformerConfig

    return [f.name for f in fields(TransformerConfig)]


def current_layout(saved: Mapping[str, Any]) -> dict[str, Any]:
    """`saved` (a checkpoint's hyperparameters) in the current layout: architecture fields saved
    flat move under `arch` (when there is no `arch`), plugins named by a `{class_path, init_args}`
    mapping become the class path and its options; None for options or route_kinds means their
    defaults."""
    settings = {k: v for k, v in saved.items() if k not in architecture_fields()}
    if ARCH in saved:  # the current layout: flat fields beside it are not read (nor built)
        arch = dict(saved[ARCH] or {})
    else:
        arch = {k: v for k, v in saved.items() if k in architecture_fields()}
    for kind in PLUGIN_KINDS:
        spec = arch.get(kind)
        if isinstance(spec, Mapping) and "class_path" in spec:
            arch[kind] = spec["class_path"]
            arch[f"{kind}_options"] = {**dict(spec.get("init_args") or {}),
                                       **dict(arch.get(f"{kind}_options") or {})}
    for key in ("residual_options", "router_options", "router_options_by_kind", "route_kinds"):
        if key in arch and arch[key] is None:
            del arch[key]
    if arch:
        settings[ARCH] = arch
    return settings


def upgrade_checkpoint(raw: dict) -> dict:
    """`raw`, a checkpoint as read (and checked to be one), with NAG's state complete and, where the
    checkpoint trained with the magnitude angle as the default of its time, that angle named in its
    residual options; in place. The hyper-parameters keep their layout (the trust check reads them
    as written); every reader of them goes through `current_layout`."""
    saved, state = raw.get("hyper_parameters"), raw.get("state_dict")
    if not (isinstance(saved, dict) and isinstance(state, dict)):
        return raw
    options = dict(current_layout(saved).get(ARCH, {}).get("residual_options") or {})
    upgraded = upgrade_nag_state(state, options)
    if upgraded is not None and upgraded != options:
        where = saved[ARCH] if isinstance(saved.get(ARCH), dict) else saved
        spec = where.get("residual")
        if isinstance(spec, dict) and "class_path" in spec:  # its options move to residual_options
            spec["init_args"] = {}
        where["residual_options"] = upgraded
    return raw


def upgrade_nag_state(state: dict, options: Mapping[str, Any], prefix: str = NAG_PREFIX) -> dict | None:
    """Bring the saved state of a NAG strategy (any class that keeps NAG's state, named or by class
    path) in `state` to the current format, in place, given the checkpoint's residual `options`;
    other strategies' states, and NAG's in the current format, are left alone. Returns the options
    to build the strategy with, in the current names (the magnitude angle named where `options`
    leave the angle to the default, which is the gate now), or None where nothing changed."""
    import torch

    key = prefix + "_extra_state"
    alpha = state.get(prefix + "alpha")
    if key not in state:
        if not (torch.is_tensor(alpha) and alpha.ndim == 1 and prefix + "beta" in state):
            return None  # not NAG's parameters
        state[key] = {  # saved before the settings were
            "theta_max": _given(options, "theta_max", 2.0 / alpha.shape[0]),
            "norm_lane_readout": _given(options, "norm_lane_readout", False),
            "bound": options.get("bound", "tanh"),
        }
    settings = state[key]
    if not isinstance(settings, dict) or "theta_max" not in settings:
        return None  # another strategy's extra state, or NAG's as it is saved now
    for name, value in NAG_BEFORE.items():
        settings.setdefault(name, value)
    options = current_nag_options(options, settings["angle"])
    if settings["angle"] == "magnitude" and options.get("angle") is None:
        options["angle"] = "magnitude"
    state[key], state[prefix + "angle._extra_state"], state[prefix + "bound._extra_state"] = nag_parts(settings)
    for old, new in NAG_MOVED.items():
        if prefix + old in state:
            state[prefix + new] = state.pop(prefix + old)
    return options


def nag_parts(settings: dict) -> tuple[dict, dict, dict]:
    """A flat dict of NAG's settings of before the parts, split into the residual's, its angle's
    and its bound's. Values that were never valid pass on as they are, for the parts to refuse."""
    angle, reads = settings.get("angle"), settings.get("gate_reads")
    residual = {"angle": f"gate_{reads}" if angle == "gate" and reads != "state" else angle,
                "bound": "learned" if settings.get("learned_bound") is True else settings.get("bound_schedule"),
                "norm_lane_readout": settings.get("norm_lane_readout"),
                "channel_scale": settings.get("channel_scale")}
    if "planes" in settings:
        residual["planes"] = settings["planes"]
    owned = NAG_ANGLE_SETTINGS.get(angle, ()) if isinstance(angle, str) else ()
    angle_settings = {"saturation" if name == "bound" else name: settings.get(name) for name in owned}
    return residual, angle_settings, {"theta_max": settings.get("theta_max")}


def current_nag_options(options: Mapping[str, Any], angle: object) -> dict:
    """NAG's residual `options` of a checkpoint from before the parts (trained with `angle`) in the
    current names: the flags that selected a bound or a gate become `bound` and `angle`, and the
    magnitude angle's `bound` its `saturation` (ignored by the other angles then, dropped)."""
    options = dict(options)
    saturation = options.pop("bound", None)
    if saturation is not None and angle == "magnitude":
        options["saturation"] = saturation
    schedule = options.pop("bound_schedule", None)
    if options.pop("learned_bound", False) is True:
        options["bound"] = "learned"
    elif schedule is not None:
        options["bound"] = schedule
    reads = options.pop("gate_reads", None)
    if reads is not None and reads != "state":
        options["angle"] = f"gate_{reads}"
    return options


def _given(options: Mapping[str, Any], name: str, default: object) -> object:
    return default if options.get(name) is None else options[name]


def legacy_settings(model: Mapping[str, Any]) -> list[str]:
    """The keys of a `model` section of a config (or command line) written in the layout before
    `model.arch`, which would otherwise fail without saying why."""
    return [key for key in model if key in architecture_fields()]


def legacy_layout_sentence(where: str, keys: list[str]) -> str:
    """The one sentence that says how an older config maps to the current one."""
    return (
        f"{where} sets {', '.join(f'model.{k}' for k in keys)}, but the architecture settings "
        f"({', '.join(architecture_fields())}) now live under model.arch: write "
        f"model.arch.{keys[0]} for model.{keys[0]}, and a plugin's options in "
        "model.arch.residual_options or model.arch.router_options rather than class_path/init_args "
        "(docs/usage.md, 'Configs written before model.arch')."
    )


def refuse_older_layout(argv: list[str]) -> None:
    """One sentence, instead of the parser's list of unknown keys, for a config file or option
    written before the architecture moved under `model.arch`."""
    import yaml

    options = [a.split("=", 1)[0][len("--model."):] for a in argv if a.startswith("--model.")]
    keys = legacy_settings(options)
    if keys:
        raise ValueError(legacy_layout_sentence("The command line", keys))
    files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    files += [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    for path in files:
        try:
            with open(path) as handle:
                config = yaml.safe_load(handle)
        except (OSError, yaml.YAMLError):
            continue  # the parser says what is wrong with it
        if not isinstance(config, dict):
            continue
        # the model section at the top, or under a subcommand (`--config` before `fit`)
        for section in [config, *(v for v in config.values() if isinstance(v, dict))]:
            model = section.get("model")
            keys = legacy_settings(model) if isinstance(model, dict) else []
            if keys:
                raise ValueError(legacy_layout_sentence(f"The config {path}", keys))


MOVED_MODULES = {
    "nag_lightning.kv_cache": "nag_lightning.model.kv_cache",
    "nag_lightning.inference": "nag_lightning.model.inference",
    "nag_lightning.compile": "nag_lightning.model.compile",
    "nag_lightning.flops": "nag_lightning.model.flops",
    "nag_lightning.routing_stats": "nag_lightning.model.routing_stats",
    "nag_lightning.tokenizer": "nag_lightning.data.tokenizer",
    "nag_lightning.orphans": "nag_lightning.data.orphans",
    "nag_lightning.module": "nag_lightning.training.module",
    "nag_lightning.runs": "nag_lightning.training.runs",
    "nag_lightning.sharding": "nag_lightning.training.sharding",
    "nag_lightning.quiet": "nag_lightning.training.quiet",
    "nag_lightning.checkpoint": "nag_lightning.checkpoints.reader",
    "nag_lightning.trust": "nag_lightning.checkpoints.trust",
    "nag_lightning.compat": "nag_lightning.checkpoints.compat",
    "nag_lightning.saved_settings": "nag_lightning.checkpoints.settings",
    "nag_lightning.plotting": "nag_lightning.analysis.reports.plotting",
    "nag_lightning.callbacks.checkpoint": "nag_lightning.callbacks.run_checkpoint",
    "nag_lightning.analysis.study": "nag_lightning.analysis.studies.study",
    "nag_lightning.analysis.depth_study": "nag_lightning.analysis.studies.depth",
    "nag_lightning.analysis.isoflop_study": "nag_lightning.analysis.studies.isoflop",
    "nag_lightning.analysis.tradeoff_study": "nag_lightning.analysis.studies.tradeoff",
    "nag_lightning.analysis.tasks_study": "nag_lightning.analysis.studies.tasks",
    "nag_lightning.analysis.sweep_report": "nag_lightning.analysis.sweeps.report",
    "nag_lightning.analysis.sweepable": "nag_lightning.analysis.sweeps.sweepable",
    "nag_lightning.analysis.sweep": "nag_lightning.analysis.sweeps.sweep",
    "nag_lightning.analysis.probes": "nag_lightning.analysis.sweeps.probes",
    "nag_lightning.analysis.oracle": "nag_lightning.analysis.sweeps.oracle",
    "nag_lightning.analysis.generate": "nag_lightning.analysis.evaluation.generate",
    "nag_lightning.analysis.lm_eval_command": "nag_lightning.analysis.evaluation.lm_eval_command",
    "nag_lightning.analysis.compare": "nag_lightning.analysis.reports.compare",
    "nag_lightning.analysis.plotting": "nag_lightning.analysis.reports.plotting",
}
"""Where each module of earlier releases lives now: an old module path (saved as part of a class
path) imports as the module that replaced it, the same module object, so its classes are the same."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module path (`MOVED_MODULES`) as the module now at the new one."""

    def find_spec(self, fullname: str, path: object, target: object = None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec) -> ModuleType:
        module = importlib.import_module(MOVED_MODULES[spec.name])
        spec.loader_state = module.__spec__  # the import machinery sets the alias's spec on it
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state  # already run: only give its own spec back


def install_moved_modules() -> None:
    """Let the old module paths import (idempotent). First in line, so a stale file left at an old
    path by an install over an earlier release is never imported beside the module that replaced it."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())
