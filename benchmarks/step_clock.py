"""A callback that times a `fit` from the command's start: `bench_first_steps.py` gives it to
every run it times. The start is the wall-clock time in STEP_CLOCK_START (set by whoever launched
the process); the times go, as JSON, to the file STEP_CLOCK_OUT when training ends. With
STEP_CLOCK_STOP=N the run stops after N steps whatever its max_steps, so a run that keeps its
recipe's length (which NAG's CPU write reads to decide whether to compile) can be timed in part:

    to_first_step   command's start to the start of the first training batch (imports, setup,
                    data loading, the sanity check)
    first_step      the first training batch, forward, backward and optimizer step
    total           command's start to the end of training
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import lightning as L


class StepClock(L.Callback):
    def __init__(self) -> None:
        self.start = float(os.environ["STEP_CLOCK_START"])
        self.times: dict[str, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if "to_first_step" not in self.times:
            self.times["to_first_step"] = time.time() - self.start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if "first_step" not in self.times:
            self.times["first_step"] = time.time() - self.start - self.times["to_first_step"]
        stop = os.environ.get("STEP_CLOCK_STOP")
        if stop is not None and trainer.global_step >= int(stop):
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        self.times["total"] = time.time() - self.start
        self.times["steps"] = trainer.global_step
        Path(os.environ["STEP_CLOCK_OUT"]).write_text(json.dumps(self.times))
