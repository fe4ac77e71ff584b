"""Lightning callbacks: depth and stream diagnostics, FLOP accounting and budgets, run checkpoints,
weight projection, the run's length for NAG's CPU write."""

from nag_lightning.callbacks.budget import FlopBudget, find_budget
from nag_lightning.callbacks.depth import DepthDiagnostics
from nag_lightning.callbacks.flops import FlopAccounting
from nag_lightning.callbacks.projection import WeightProjection
from nag_lightning.callbacks.run_checkpoint import RunCheckpoint
from nag_lightning.callbacks.run_length import RunLength
from nag_lightning.callbacks.stream import StreamDiagnostics

__all__ = [
    "DepthDiagnostics", "FlopAccounting", "FlopBudget", "RunCheckpoint", "RunLength", "StreamDiagnostics",
    "WeightProjection", "find_budget",
]
