"""FLOP budget: stop training at the step whose total training FLOPs first reach a budget.

DESIGN section 5, the tool of iso-FLOP comparisons: every run spends the same compute, and a routed
(MoD) model that executes fewer FLOPs per token trains on more tokens. The total is
`FlopAccounting`'s (3 x forward, all ranks, real executed counts), so the budget needs that
callback in the same Trainer: the budget reads the accounting's totals after each training batch,
once the accounting has counted it (the accounting knows nothing of the budget).
Both keep their state in checkpoints: a resumed run spends only the remainder and stops at the same
step as an uninterrupted one.

The budget is a number of FLOPs, or a number of tokens of a reference: "what the full-depth,
unrouted baseline of this model's config spends on N tokens" (`reference_tokens`), which gives runs
of one config but different routers the same budget without a calculator.

The stop is `trainer.should_stop`, so Lightning runs a last validation at that step (the final
number of an iso-FLOP table) and honours `trainer.min_steps` / `min_epochs` if they are set.

`progress`, the fraction of the budget spent so far, places the decay of the warmup-stable-decay
learning-rate schedule (`model.schedule: wsd`) at the end of each run's own budget. At setup, before
the optimizers are configured, the budget hands itself to a module that has a
`follow_budget(budget)` hook (the package's `LanguageModel` does), so the module never looks
for its callbacks. Any module opts in the same way, or finds the budget itself: its scheduler
reads `progress` at every step, e.g. a linear decay toward zero at
the end of the budget (Lightning steps schedulers before the callbacks' end of the batch, so a
step's rate follows the FLOPs spent up to the step before it):

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        budget = find_budget(self.trainer)
        decay = LambdaLR(optimizer, lambda step: 1.0 - budget.progress)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

(`nag_lightning.training.optim.warmup_stable_decay(step, warmup, budget.progress, decay_fraction,
min_ratio)` gives the package's own schedule.)
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from nag_lightning.callbacks.flops import FlopAccounting, find_accounting
from nag_lightning.model.flops import TRAINING_MULTIPLIER


class FlopBudget(L.Callback):
    """Stops training once the total training FLOPs reach a budget.

    Give exactly one of:

    Args:
        budget: training FLOPs to spend (3 x forward, summed over all ranks), e.g. 2.0e13.
        reference_tokens: spend what the full-depth, unrouted baseline of this model's config spends
            on this many tokens (at the model's seq_len). For a model of this package, or one whose
            FLOP counter or LightningModule defines `full_depth_forward_flops_per_token()`; a
            measured module has no baseline to refer to.
    """

    def __init__(self, budget: float | None = None, reference_tokens: int | None = None) -> None:
        if (budget is None) == (reference_tokens is None):
            raise ValueError(
                "FlopBudget needs exactly one of budget (training FLOPs) and reference_tokens "
                f"(tokens of the full-depth baseline); got budget={budget}, "
                f"reference_tokens={reference_tokens}."
            )
        if budget is not None and not budget > 0:
            raise ValueError(f"The FLOP budget must be a positive number of FLOPs; got {budget}.")
        if reference_tokens is not None and not reference_tokens > 0:
            raise ValueError(f"reference_tokens must be a positive number of tokens; got {reference_tokens}.")
        self.budget_flops = budget
        self.reference_tokens = reference_tokens
        self.budget: float | None = budget  # resolved at setup when given as reference_tokens
        self.stopped_at: int | None = None  # the global step training stopped at
        self.spent: int | None = None  # training FLOPs spent by then
        self._saved_budget: float | None = None
        self._accounting: FlopAccounting | None = None

    @property
    def progress(self) -> float:
        """Training FLOPs spent so far over the budget, 0 to 1 (0 before training starts). The
        spent total is FlopAccounting's, kept in checkpoints, so a resumed run reads on."""
        if self._accounting is None or not self.budget:
            return 0.0
        return min(self._accounting.training_flops / self.budget, 1.0)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        accounting = find_accounting(trainer)
        if accounting is None:
            raise ValueError(
                "FlopBudget counts with FlopAccounting: add "
                "nag_lightning.callbacks.FlopAccounting to trainer.callbacks as well."
            )
        self._accounting = accounting
        self._counted_steps = accounting.steps
        follow = getattr(pl_module, "follow_budget", None)  # optional: any module may train here
        if callable(follow):
            follow(self)
        self.stopped_at = self.spent = None
        self._saved_budget = None
        if self.reference_tokens is not None:
            counter = accounting.ensure_counter(pl_module)
            per_token = (getattr(counter, "full_depth_forward_flops_per_token", None)
                         or getattr(pl_module, "full_depth_forward_flops_per_token", None))
            if per_token is None:
                raise ValueError(
                    f"Neither {type(pl_module).__name__} nor its {type(counter).__name__} can say "
                    "what the full-depth baseline spends per token; give the budget in FLOPs "
                    "(budget=...) instead of reference_tokens, or define "
                    "`full_depth_forward_flops_per_token(self)` on the module."
                )
            self.budget = float(TRAINING_MULTIPLIER * per_token() * self.reference_tokens)
            rank_zero_info(
                f"FlopBudget: {self.budget:.4g} training FLOPs, what the full-depth baseline "
                f"spends on {self.reference_tokens} tokens."
            )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._saved_budget is not None and self._saved_budget != self.budget:
            rank_zero_warn(
                f"FlopBudget: the checkpoint was trained toward a budget of {self._saved_budget:.6g} "
                f"FLOPs; this run continues toward {self.budget:.6g}."
            )
        self.stopped_at = self.spent = None
        self._counted_steps = self._accounting.steps  # a resumed run's, restored by now
        spent = self._accounting.training_flops
        if spent >= self.budget:
            rank_zero_info(
                f"FlopBudget: {spent:.6g} of {self.budget:.6g} training FLOPs were already spent; "
                "nothing left to train."
            )
            self._stop(trainer, spent)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        accounting = self._accounting
        accounting.count(trainer, pl_module, batch_idx)  # if it has not yet: callbacks run in list order
        if accounting.steps == self._counted_steps:
            return  # accumulating gradients: no optimizer step was counted
        self._counted_steps = accounting.steps
        total, step = accounting.training_flops, accounting.last["step"]
        if total == step and step > self.budget:  # the run's very first step overshoots
            raise ValueError(
                f"The FLOP budget of {self.budget:.6g} is smaller than one training step, which "
                f"costs {step:.6g} FLOPs here; raise the budget or shrink the batch."
            )
        if total >= self.budget:
            rank_zero_info(
                f"FlopBudget: {total:.6g} training FLOPs spent at step {trainer.global_step}, "
                f"reaching the budget of {self.budget:.6g}; stopping."
            )
            self._stop(trainer, total)

    def _stop(self, trainer: L.Trainer, spent: int) -> None:
        trainer.should_stop = True
        self.stopped_at = trainer.global_step
        self.spent = spent

    def state_dict(self) -> dict:
        return {"budget": self.budget, "stopped_at": self.stopped_at, "spent": self.spent}

    def load_state_dict(self, state_dict: dict) -> None:
        for key in ("budget", "stopped_at", "spent"):  # untrusted input: numbers or None
            value = state_dict.get(key) if isinstance(state_dict, dict) else "?"
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value >= 0):
                raise ValueError(
                    f"The checkpoint's {type(self).__name__} state holds {key}={value!r}, not a "
                    "non-negative number; give an undamaged checkpoint written by `nag-lightning fit`."
                )
        self._saved_budget = state_dict.get("budget")
        self.stopped_at = state_dict.get("stopped_at")
        self.spent = state_dict.get("spent")


def find_budget(trainer: L.Trainer) -> FlopBudget | None:
    """The trainer's FlopBudget callback, if it has one: what a learning-rate schedule reads
    `progress` from."""
    return next((c for c in trainer.callbacks if isinstance(c, FlopBudget)), None)
