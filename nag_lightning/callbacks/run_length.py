"""Run length: tell NAG's CPU write how many steps the training run has left.

Compiling the write (`nag_kernels.compiled`) costs about 30 s of CPU with a cold cache and saves a
little on every step, so whether it pays depends on the run's length as much as on the write's
size: a long run compiles writes a short one would not repay (`MIN_RUN_ELEMENTS`). NAG names this
callback among its `training_callbacks`, so the LightningModule adds it to every NAG run.
"""

from __future__ import annotations

import lightning as L

from nag_kernels.compiled import expect_training_steps


class RunLength(L.Callback):
    """Sets `nag_kernels.compiled.expect_training_steps` to the steps left when training starts
    (fewer after a resume), and clears it when training ends or stops in an error."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        expect_training_steps(max(trainer.estimated_stepping_batches - trainer.global_step, 0))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        expect_training_steps(None)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        expect_training_steps(None)
