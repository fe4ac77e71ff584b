"""Lightning callbacks: depth diagnostics, FLOP accounting, FLOP budgets and run checkpoints."""

from nag_lightning.callbacks.budget import FlopBudget
from nag_lightning.callbacks.checkpoint import RunCheckpoint
from nag_lightning.callbacks.depth import DepthDiagnostics
from nag_lightning.callbacks.flops import FlopAccounting

__all__ = ["DepthDiagnostics", "FlopAccounting", "FlopBudget", "RunCheckpoint"]
