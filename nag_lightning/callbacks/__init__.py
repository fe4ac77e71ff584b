"""Lightning callbacks: depth diagnostics, FLOP accounting and FLOP budgets."""

from nag_lightning.callbacks.budget import FlopBudget
from nag_lightning.callbacks.depth import DepthDiagnostics
from nag_lightning.callbacks.flops import FlopAccounting

__all__ = ["DepthDiagnostics", "FlopAccounting", "FlopBudget"]
