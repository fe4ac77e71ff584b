"""Silence the messages Lightning and torch print on every run that say nothing about the run.

Each is matched precisely (its logger or its warning text), so every other warning still shows:

- Lightning's tip to install litlogger, logged at info level on every fit;
- torch's deprecation of `isinstance(treespec, LeafSpec)`, which Lightning's own pytree helper
  triggers (nothing a user of this package can change);
- "Your `IterableDataset` has `__len__` defined": the litdata `StreamingDataset` splits its chunks
  between dataloader workers itself, so the length it reports is right with any number of workers.
"""

from __future__ import annotations

import logging
import warnings

# The loggers Lightning's rank_zero_info writes to: the Trainer's, and Fabric's.
RANK_ZERO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in str(record.msg)


_FILTER = _DropLitLoggerTip()


def silence_irrelevant_messages() -> None:
    """Install the filters (idempotent); call before building the Trainer."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
    for name in RANK_ZERO_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
