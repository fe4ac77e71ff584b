"""Lightning callbacks: depth diagnostics (and, in their own modules, FLOP accounting and budgets)."""

from nag_lightning.callbacks.depth import DepthDiagnostics

__all__ = ["DepthDiagnostics"]
