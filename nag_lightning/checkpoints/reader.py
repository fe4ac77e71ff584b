"""The one reader of `nag-lightning fit` checkpoints: a file is read once, into a `SavedCheckpoint`
that every model is built from (`nag_lightning.checkpoints.loading.load_model`).

A checkpoint is untrusted input, and a file read twice may have changed in between (a file swapped
after its trust check could make the second read name other code). So each command reads each
checkpoint file exactly once (`read_saved`: `weights_only=True`, local or remote, via
`nag_lightning.checkpoints.trust`), checks what it holds on that one object, and builds everything
from it: the model and tokenizer (`loading.load_model`, for every command and the module), the
data settings (`sweep`, the studies), the totals (`compare`), the step (`runs`), and Lightning's
own restore (`PreloadedCheckpointIO` hands the Trainer the dict already read). Older layouts of the
saved settings are read through `nag_lightning.checkpoints.settings`.

Everything inside is checked as input, not only the pickle: the saved settings must be a mapping,
the weights a mapping of tensors whose shapes fit the model those settings describe, the step and
the loop counters non-negative integers, and the tokenizer must fit the model's vocabulary
(`nag_lightning.data.tokenizer.load_saved`). Paths in callback state are checked by the callbacks that
use them (`nag_lightning.callbacks.run_checkpoint`).

A folder written by `nag-lightning export` (`export`, beside this module) is read here too, from JSON
and safetensors, into the same dict: every command that takes a checkpoint takes such a folder.
Which kind a path is, `formats` decides.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from nag_lightning.checkpoints.compat import upgrade_checkpoint
from nag_lightning.checkpoints.exported import read_exported
from nag_lightning.checkpoints.formats import SavedFormat, hf_folder_not_read, saved_format
from nag_lightning.checkpoints.settings import saved_architecture, saved_model_settings
from nag_lightning.checkpoints.trust import check_plugins, read_checkpoint
from nag_lightning.checkpoints.values import check_finite, check_lightning_version, check_saved_settings
from nag_lightning.data.tokenizer import Tokenizer, load_saved
from nag_lightning.inputs import shorten
from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.model.limits import TooLarge

MODEL_PREFIX = "model."  # the Transformer's weights in a LightningModule's state dict
_PROGRESS_KEYS = frozenset({"ready", "started", "processed", "completed"})


@dataclass(eq=False)
class SavedCheckpoint:
    """A checkpoint as read, once, from `source`; `raw` is the dict Lightning restores from."""

    source: str
    raw: dict
    exported: bool = False  # a folder of `nag-lightning export`: weights, but no training state

    @property
    def hyper_parameters(self) -> dict:
        return self.raw["hyper_parameters"]

    @cached_property
    def settings(self) -> dict:
        """The saved module settings in the current layout (`settings.saved_model_settings`)."""
        return saved_model_settings(self.hyper_parameters)

    @cached_property
    def arch(self) -> dict:
        """The `TransformerConfig` settings, in the current layout."""
        return saved_architecture(self.hyper_parameters)

    @property
    def state_dict(self) -> dict:
        return self.raw["state_dict"]

    @property
    def data(self) -> dict:
        """The data module settings the run saved (empty if none)."""
        saved = self.raw.get("datamodule_hyper_parameters")
        return dict(saved) if isinstance(saved, Mapping) else {}

    @property
    def global_step(self) -> int:
        return self.raw.get("global_step", 0)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer the checkpoint holds, checked against the model's vocabulary."""
        return load_saved(self.raw.get("tokenizer"), self.arch.get("vocab_size"), self.source)

    def check_plugins(self, trusted: bool, configured: Mapping | None = None, replaced=()) -> None:
        """`nag_lightning.checkpoints.trust.check_plugins` on this checkpoint."""
        check_plugins(self.raw, self.source, trusted, configured, replaced)

    @property
    def model_weights(self) -> dict:
        """The `Transformer`'s weights, without the LightningModule's prefix."""
        return {k[len(MODEL_PREFIX):]: v for k, v in self.state_dict.items() if k.startswith(MODEL_PREFIX)}

    def check_weights(self, arch: Mapping[str, Any] | None = None) -> None:
        """One sentence if the weights do not fit the `Transformer` the saved settings (or `arch`)
        describe, or its plugins refuse the settings they saved, checked on the meta device:
        settings that do not fit allocate nothing."""
        try:
            config = TransformerConfig(**(self.arch if arch is None else arch))
        except TooLarge as error:
            raise ValueError(
                f"The checkpoint {self.source} describes a model this machine cannot hold: "
                f"{error.problem}; {error.checkpoint_advice}."
            ) from None
        with torch.device("meta"):
            model = Transformer(config)
        check_weights(model.state_dict(), self.model_weights, self.source)
        check_saved_settings(model, self.model_weights, self.source)


def refuse_full_unpickle(weights_only: bool | None, advice: str) -> None:
    """One sentence, ending in `advice`, for a load asked to unpickle a checkpoint in full."""
    if weights_only is False:
        raise ValueError(
            "Checkpoints load with weights_only=True only, because a checkpoint may come from "
            f"anyone and a full unpickle can run its code; {advice}."
        )


def read_saved(path: str | Path) -> SavedCheckpoint:
    """The checkpoint at `path` (a local file, a URL, or a folder of `nag-lightning export`: which
    one, `formats.saved_format` says), read once and checked as plain data; one sentence
    (ValueError, FileNotFoundError) when it is not a checkpoint of `nag-lightning fit` or an
    export of one."""
    source = str(path)
    kind = saved_format(source)
    if kind is SavedFormat.HF:  # read by nag_lightning.load through nag_lightning.hf, not by the commands
        raise hf_folder_not_read(source)
    exported = kind is SavedFormat.EXPORT
    raw = read_exported(source) if exported else read_checkpoint(source)
    check_contents(raw, source)
    check_finite(raw["state_dict"], source)
    check_lightning_version(raw, source)
    return SavedCheckpoint(source, upgrade_checkpoint(raw), exported)


def damaged_last(path: str | Path) -> ValueError:
    """The sentence for a `last.ckpt` that `--ckpt_path last` cannot read: which file is damaged,
    and the newest other readable checkpoint beside it to resume from instead."""
    path = Path(path)
    others = sorted((p for p in path.parent.glob("*.ckpt") if p.name != path.name and p.is_file()),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    instead = None
    for other in others:
        try:
            read_saved(other)
        except (ValueError, FileNotFoundError):
            continue
        instead = other
        break
    advice = (f"resume from the newest readable checkpoint beside it with --ckpt_path {instead}"
              if instead else f"no other checkpoint in {path.parent} is readable: start a new run "
              "without --ckpt_path")
    return ValueError(
        f"{path}, the checkpoint --ckpt_path last resumes from, is damaged (empty, truncated or not "
        f"a torch file); {advice}, or move the damaged file aside."
    )


def check_contents(raw: Mapping, source: str) -> None:
    """One sentence unless `raw` holds what `nag-lightning fit` writes: settings and weights as
    mappings, a step and loop counters that are non-negative integers."""
    missing = [key for key in ("hyper_parameters", "state_dict") if not isinstance(raw.get(key), Mapping)]
    if missing:
        raise ValueError(
            f"The checkpoint {source} is not a checkpoint of `nag-lightning fit` (no "
            f"{' or '.join(missing)}); give a .ckpt file from a run's checkpoints/ folder."
        )
    not_tensors = [k for k, v in raw["state_dict"].items()
                   if not isinstance(k, str) or not (torch.is_tensor(v) or k.endswith("_extra_state"))]
    problems = [f"state_dict[{shorten(repr(k))}] is not a tensor" for k in not_tensors[:1]]
    for key in ("global_step", "epoch"):
        if key in raw and not _count(raw[key]):
            problems.append(f"{key}={shorten(repr(raw[key]))} is not a non-negative integer")
    if "loops" in raw:
        problems += _loop_problems(raw["loops"], "loops")[:1]
    if problems:
        raise ValueError(
            f"The checkpoint {source} holds a state that `nag-lightning fit` does not write "
            f"({problems[0]}); give an undamaged .ckpt file from a run's checkpoints/ folder."
        )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _loop_problems(state: object, where: str) -> list[str]:
    """What in Lightning's saved loop state is not what its loops write: nested mappings, progress
    counters that are non-negative integers (the loops do arithmetic with them on resume)."""
    if not isinstance(state, Mapping):
        return [f"{where} is not a mapping"]
    problems = []
    for key, value in state.items():
        if key in _PROGRESS_KEYS and not _count(value):
            problems.append(f"{where}[{key!r}]={shorten(repr(value))} is not a non-negative integer")
        elif key == "_batches_that_stepped" and not _count(value):
            problems.append(f"{where}[{key!r}]={shorten(repr(value))} is not a non-negative integer")
        elif key == "is_last_batch" and not isinstance(value, bool):
            problems.append(f"{where}[{key!r}]={shorten(repr(value))} is not true or false")
        elif isinstance(value, Mapping) and key != "combined_loader":
            problems += _loop_problems(value, f"{where}[{key!r}]")
    return problems


def check_weights(expected: Mapping[str, Any], given: Mapping[str, Any], source: str = "") -> None:
    """One sentence if a weight of `given` (a checkpoint's) has another shape than the model its
    settings describe (`expected`, its state dict), or integers where it holds floating point
    numbers or the reverse (loading would cast them silently)."""
    for name, value in given.items():
        want = expected.get(name)
        if not (torch.is_tensor(want) and torch.is_tensor(value)):
            continue
        if value.shape != want.shape:
            detail = f"{name} is {list(value.shape)}, the model's {list(want.shape)}"
            raise _weights_do_not_fit(source, detail)
        if value.is_floating_point() != want.is_floating_point():
            raise _weights_do_not_fit(source, f"{name} is {value.dtype}, the model's {want.dtype}")


@contextmanager
def fitting_weights(
    expected: Mapping[str, Any], given: Mapping[str, Any], source: str = ""
) -> Iterator[None]:
    """Around a `load_state_dict(given)` into a model whose state dict is `expected`: weights
    that do not fit (shapes, missing or unexpected names) said in one sentence."""
    check_weights(expected, given, source)
    try:
        yield
    except RuntimeError as error:
        text = str(error)  # torch lists the names after a line ending in a colon
        detail = text.split("\n\t")[1] if "\n\t" in text else text
        raise _weights_do_not_fit(source, detail.strip()[:200]) from None


def _weights_do_not_fit(source: str, detail: str) -> ValueError:
    return ValueError(
        f"The checkpoint {source + ' ' if source else ''}holds weights that do not fit the model its "
        f"settings describe ({detail}); give an undamaged checkpoint written by `nag-lightning fit`."
    )

