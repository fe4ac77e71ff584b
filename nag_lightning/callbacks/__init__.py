"""Lightning callbacks: depth diagnostics, FLOP accounting and budgets, run checkpoints, weight projection."""

from nag_lightning.callbacks.budget import FlopBudget, find_budget
from nag_lightning.callbacks.depth import DepthDiagnostics
from nag_lightning.callbacks.flops import FlopAccounting
from nag_lightning.callbacks.projection import WeightProjection
from nag_lightning.callbacks.run_checkpoint import RunCheckpoint

__all__ = [
    "DepthDiagnostics", "FlopAccounting", "FlopBudget", "RunCheckpoint", "WeightProjection", "find_budget",
]
