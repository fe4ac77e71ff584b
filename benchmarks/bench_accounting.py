"""Step-time overhead of FLOP accounting + a FLOP budget, against the same training without them.

One process, one real Lightning Trainer per model. The accounting's per-step hook (which also runs
the budget's check) runs on half the optimizer steps, picked in a shuffled balanced order, so steps
with and without it interleave within the same run and see the same machine load; medians over
steps. A last A/A run, where the hook runs on no step, shows the noise floor of the comparison.
Per model:

    step time   median time between consecutive `on_train_batch_start`s: everything a step costs,
                callbacks included; with / without - 1 is the overhead
    hook time   median time spent inside that hook on the steps it ran: the overhead measured
                directly, without the noise of the step time around it

(The accounting's forward pre-hook, a few microseconds, runs on every step, so it is in both.)

    python3 benchmarks/bench_accounting.py [--steps 200] [--warmup 10]
"""

from __future__ import annotations

import argparse
import logging
import random
import statistics
import time
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader

from nag_lightning.callbacks import FlopAccounting, FlopBudget
from nag_lightning.model import TransformerConfig
from nag_lightning.training.module import LanguageModel

# The model and batch of recipes/isoflop/: d 64, 4 layers, 128 bytes, batch 8.
MODEL = dict(d_model=64, n_layers=4, n_heads=4, seq_len=128)
BATCH = 8
ROUTERS = {"none": {}, "topk": {"capacity": 0.75}}


class SwitchedAccounting(FlopAccounting):
    """FlopAccounting whose per-step hook (counting, the all-reduce, the budget's check, logging)
    runs, timed, on the steps in `on` only; with `control`, on none of them (an A/A run: what
    the comparison shows when nothing differs)."""

    def __init__(self, on: set[int], spent: dict[int, float], control: bool = False) -> None:
        super().__init__()
        self.on, self.spent, self.control = on, spent, control

    def on_train_batch_end(self, trainer, *args) -> None:
        step = trainer.global_step - 1  # the step this batch belonged to
        if step in self.on and not self.control:
            start = time.perf_counter()
            super().on_train_batch_end(trainer, *args)
            self.spent[step] = time.perf_counter() - start


class StepTimer(L.Callback):
    """Time of each step: from its batch start to the next one's."""

    def __init__(self) -> None:
        self.times: dict[int, float] = {}
        self._start: tuple[int, float] | None = None

    def on_train_batch_start(self, trainer, *args) -> None:
        now = time.perf_counter()
        if self._start is not None:
            step, start = self._start
            self.times[step] = now - start
        self._start = (trainer.global_step, now)


def measure(router: str, steps: int, warmup: int, control: bool = False) -> dict[str, float]:
    # Steps with and without the hook in a shuffled, balanced order, so that nothing periodic in
    # the machine or the loop lines up with them.
    on = set(random.Random(0).sample(range(steps + 1), (steps + 1) // 2))
    torch.manual_seed(0)
    arch = TransformerConfig(**MODEL, router=router, router_options=ROUTERS[router])
    module = LanguageModel(arch, warmup_steps=5)
    data = torch.randint(0, 256, (BATCH * (steps + 1), MODEL["seq_len"] + 1))
    timer, spent = StepTimer(), {}
    accounting = SwitchedAccounting(on, spent, control)
    budget = FlopBudget(budget=1e30)  # never reached; it checks inside the accounting's hook
    callbacks = [timer, accounting, budget]
    L.Trainer(accelerator="cpu", max_steps=steps + 1, callbacks=callbacks, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
              limit_val_batches=0).fit(module, DataLoader(data, batch_size=BATCH))
    kept = {s: t for s, t in timer.times.items() if s >= warmup}
    with_ = statistics.median(t for s, t in kept.items() if s in on)
    without = statistics.median(t for s, t in kept.items() if s not in on)
    hooks = [t for s, t in spent.items() if s >= warmup]
    assert control or accounting.steps > 0  # the accounting really ran
    hook = statistics.median(hooks) if hooks else 0.0
    return {"without": without, "with": with_, "hook": hook, "steps": len(kept)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per model")
    parser.add_argument("--warmup", type=int, default=10, help="first steps left out")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; model {MODEL}, batch {BATCH}; "
          f"{args.steps} steps, first {args.warmup} left out, with/without interleaved\n")
    print("| router | step without (ms) | step with (ms) | overhead | hook time (ms) | hook / step |")
    print("|---|---|---|---|---|---|")
    for router, control in [(r, False) for r in ROUTERS] + [("none, A/A control", True)]:
        r = measure(router.split(",")[0], args.steps, args.warmup, control)
        print(f"| {router} | {1e3 * r['without']:.1f} | {1e3 * r['with']:.1f} "
              f"| {100 * (r['with'] / r['without'] - 1):+.1f}% | {1e3 * r['hook']:.2f} "
              f"| {100 * r['hook'] / r['without']:.2f}% |")


if __name__ == "__main__":
    main()
