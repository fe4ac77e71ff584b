"""Checkpoints a run can always be resumed from: `last.ckpt` is the newest finite state.

Lightning's `ModelCheckpoint` rewrites `last.ckpt` only together with a top-k checkpoint (with a
monitor: only when validation improved), and at the end of training only if it never wrote one, so
the final steps of a run could be in no file at all. `RunCheckpoint` keeps everything
`ModelCheckpoint` does and adds:

- `last.ckpt` is rewritten at every validation and at every step that writes any checkpoint;
- the end of training is saved at the last step, whatever ended it (`max_steps`, `max_epochs`, a
  FLOP budget or another callback's `trainer.should_stop`), and on an exception or Ctrl-C;
- a state whose weights or optimizer moments are not finite is never written: the last finite
  `last.ckpt` stays, and a diverged run (`FloatingPointError`) saves nothing on its way out.

The end of training is saved at the end of its last batch rather than in `on_train_end`, because
Lightning's loops close the epoch after that, and a checkpoint of that state resumes into a new
epoch where an uninterrupted run would have continued the old one. For the same reason an
exception inside a training step is saved as the end of the last finished step: the data loader
has already handed out the batch of the unfinished step and Lightning's progress counters are half
advanced, so the checkpoint carries the loop state recorded at the last batch end (with the weights,
optimizer and scheduler, which the unfinished step has not changed yet) and a resumed run reads
that batch again, exactly as an uninterrupted run does. An exception raised after a step's
optimizer update but before its batch end (in another callback's hook) has no such consistent
state and is not saved.
"""

from __future__ import annotations

import copy
import os
import posixpath
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from nag_lightning.inputs import shorten


class RunCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` whose `last.ckpt` is always the newest finite state of the run.

    Takes ModelCheckpoint's arguments. With `save_last=False` it adds nothing but the finiteness
    check.
    """

    writes_only_finite = True  # read by the LightningModule's divergence message
    _latest_step: int | None = None  # the global step last.ckpt holds
    _loop_state: tuple[int, Any] | None = None  # (step, fit-loop state) at the last batch end
    _saving_on_exception = False

    # ---- when to write ------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._latest_step = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        # At the start the newest state is the one resumed from (or step 0: nothing to save yet).
        self._latest_step = trainer.global_step
        self._loop_state = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        # What a checkpoint written now would hold; small dicts of counters and the loader position.
        self._loop_state = (trainer.global_step, copy.deepcopy(trainer.fit_loop.state_dict()))
        if _is_final_step(trainer):
            self._save_latest(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        self._save_latest(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Normally saved at the last batch already; this catches stops no batch end saw coming.
        self._save_latest(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if isinstance(exception, FloatingPointError):
            return  # the run diverged: the state is suspect, keep the last finite checkpoint
        if self._latest_step in (None, trainer.global_step):
            return  # training has not started, or last.ckpt holds this step already
        training = not trainer.validating
        if training and (self._loop_state is None or self._loop_state[0] != trainer.global_step):
            rank_zero_warn(
                f"{type(exception).__name__} after the optimizer update of step "
                f"{trainer.global_step} and before its end; last.ckpt stays at step "
                f"{self._latest_step}."
            )
            return
        self._saving_on_exception = training  # then saved as the last batch end (see above)
        try:
            if self._should_save_on_exception(trainer) and self._state_is_finite(trainer):
                super().on_exception(trainer, pl_module, exception)
            self._save_latest(trainer)
        finally:
            self._saving_on_exception = False

    # ---- what is read back ----------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """ModelCheckpoint's, with the saved state treated as untrusted input: Lightning deletes
        stale checkpoints by the paths it holds, so a path is kept only if it resolves inside this
        run's checkpoint folder, and a score only if it is a number; whatever is dropped is said in
        one line."""
        kept = trusted_state(state_dict, self.dirpath)
        if self.dirpath and kept.get("last_model_path") == "" and isinstance(state_dict, dict) \
                and state_dict.get("last_model_path"):
            # this folder's own last.ckpt, so a resumed run rewrites it rather than write last-v1
            name = self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION
            kept["last_model_path"] = os.path.join(self.dirpath, name)
        super().load_state_dict(kept)

    # ---- what is written ------------------------------------------------------------------------

    def _save_topk_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict) -> None:
        if self.save_top_k != 0 and not self._state_is_finite(trainer):
            return
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer: L.Trainer, monitor_candidates: dict) -> None:
        if not self.save_last or not self._state_is_finite(trainer):
            return
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._latest_step = trainer.global_step

    def _save_latest(self, trainer: L.Trainer) -> None:
        """Rewrite last.ckpt unless it already holds this step."""
        if (
            not self.save_last
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.sanity_checking
            or bool(trainer.fast_dev_run)
            or self._latest_step == trainer.global_step
        ):
            return
        # Lightning skips a step's top-k checkpoint once any checkpoint holds that step; writing
        # last.ckpt here must not stop the validation that follows from writing its top-k file.
        saved_step = self._last_global_step_saved
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self._last_global_step_saved = saved_step

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> dict:
        state = super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._saving_on_exception and "loops" in checkpoint:
            checkpoint["loops"]["fit_loop"] = copy.deepcopy(self._loop_state[1])
        return state

    def _state_is_finite(self, trainer: L.Trainer) -> bool:
        """Whether the weights, buffers and optimizer state are finite on every rank; warns if not."""
        finite = _all_finite(trainer)
        finite = bool(trainer.strategy.reduce_boolean_decision(finite, all=True))
        if not finite:
            kept = f"{self.last_model_path} (step {self._latest_step})" if self.last_model_path else "nothing"
            rank_zero_warn(
                f"The weights at step {trainer.global_step} are not finite, so no checkpoint was "
                f"written; the newest finite checkpoint is {kept}."
            )
        return finite


def _all_finite(trainer: L.Trainer) -> bool:
    module = trainer.lightning_module
    tensors = [*module.parameters(), *module.buffers()]
    for optimizer in trainer.optimizers:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    checks = [torch.isfinite(t).all() for t in tensors if t.is_floating_point() and t.numel()]
    return bool(torch.stack(checks).all()) if checks else True


def _is_final_step(trainer: L.Trainer) -> bool:
    """Whether the step that just finished is the last one of `fit`, as far as a batch end can tell."""
    if trainer.should_stop:
        return True
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    epoch_loop = trainer.fit_loop.epoch_loop
    max_epochs = trainer.max_epochs
    return (
        max_epochs is not None
        and max_epochs > 0
        and trainer.current_epoch + 1 >= max_epochs
        and epoch_loop.batch_progress.current.ready >= trainer.num_training_batches
    )


_PATH_KEYS = ("best_model_path", "kth_best_model_path", "last_model_path")
_SCORE_KEYS = ("best_model_score", "kth_value", "current_score")


def trusted_state(state: object, dirpath: str | None) -> dict[str, Any]:
    """A ModelCheckpoint state read from a checkpoint, without the paths that lie outside `dirpath`
    (the run's checkpoint folder; `..` and links resolved) and the scores that are not numbers.
    The dropped entries are named in one warning."""
    if not isinstance(state, dict):
        rank_zero_warn(f"The checkpoint's {RunCheckpoint.__name__} state is not a mapping; it was dropped.")
        return {"best_model_path": ""}
    kept, dropped = dict(state), []
    # A checkpoint of another run names its own folder's files: dropped without a word.
    own = kept.get("dirpath") if isinstance(kept.get("dirpath"), str) else None
    for key in _PATH_KEYS:
        if key in kept and not _inside(kept[key], dirpath):
            if not (own != dirpath and _inside(kept[key], own)):
                dropped.append(f"{key}={shorten(repr(kept[key]))}")
            kept[key] = ""
    for key in _SCORE_KEYS:
        if key in kept and kept[key] is not None and not _is_score(kept[key]):
            dropped.append(f"{key}={shorten(repr(kept[key]))}")
            kept[key] = None
    if "best_k_models" in kept:
        models = kept["best_k_models"]
        models = models if isinstance(models, dict) else {}
        good = {path: score for path, score in models.items() if _inside(path, dirpath) and _is_score(score)}
        dropped += [f"best_k_models[{shorten(repr(path))}]" for path in models if path not in good]
        if not isinstance(kept["best_k_models"], dict):
            dropped.append(f"best_k_models={shorten(repr(kept['best_k_models']))}")
        kept["best_k_models"] = good
    if "best_model_path" not in kept:
        kept["best_model_path"] = ""
    if dropped:
        rank_zero_warn(
            f"The checkpoint's {RunCheckpoint.__name__} state names paths outside this run's checkpoint "
            f"folder {dirpath} or scores that are not numbers, which were dropped: "
            f"{', '.join(d[:120] for d in dropped)}."
        )
    return kept


def _inside(path: object, folder: str | None) -> bool:
    """Whether `path` is a non-empty local path that resolves inside `folder` (both resolved
    against the working directory, as Lightning uses them), or empty (no file)."""
    if path == "":
        return True
    if not isinstance(path, str) or folder is None:
        return False
    if "://" in path or "://" in str(folder):  # an object store: same scheme, and under the folder
        scheme, _, rest = path.partition("://")
        root_scheme, _, root = str(folder).partition("://")
        rest, root = posixpath.normpath("/" + rest), posixpath.normpath("/" + root)
        return scheme == root_scheme and rest.startswith(root.rstrip("/") + "/")
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([real, root]) == root and real != root


def _is_score(value: object) -> bool:
    if torch.is_tensor(value):
        return value.numel() == 1 and (value.is_floating_point() or not value.dtype.is_complex)
    return isinstance(value, (int, float)) and not isinstance(value, bool)
