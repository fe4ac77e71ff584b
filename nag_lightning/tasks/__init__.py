"""Synthetic tasks whose every token carries a known difficulty, so depth can be measured where it
is the bottleneck.

A task draws whole sequences from a seed. Each token comes with a label of what predicting it needs:

    UNPREDICTABLE (-1)  drawn at random: no model can do better than chance (table entries, queries)
    FORMAT (0)          fixed by the sequence's layout (separators, table keys)
    k >= 1              an answer that needs k sequential steps (hops, group elements composed)

Training is the usual language-modelling loss on every token; the labels serve evaluation
(`nag_lightning.tasks.evaluation`). Tokens are bytes (ids below 256) that print as readable text, so
the byte tokenizer, bits per byte and `generate` work unchanged.

Adding a task takes one file in this folder: subclass `Task`, decorate it with
`@TASKS.register("name")`; every module here is imported below, so it is registered on import.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass

import torch
from torch import Tensor

from nag_lightning.registry import Registry

UNPREDICTABLE = -1
FORMAT = 0


@dataclass
class Labelled:
    """Token ids and their difficulty labels, both LongTensors (batch, length)."""

    tokens: Tensor
    difficulty: Tensor


class Task:
    """Base class of synthetic tasks: `sample(n, length, generator)` draws `n` labelled sequences.

    Subclasses set `max_difficulty` (the hardest label they produce) and implement `sample`; a
    sequence is filled with whole episodes and padded with the FORMAT token `PAD` when the next
    episode would not fit, so no answer is ever cut from its question.
    """

    PAD = ord(" ")
    max_difficulty: int = 1

    def sample(self, n: int, length: int, generator: torch.Generator) -> Labelled:
        raise NotImplementedError

    def min_length(self) -> int:
        """The shortest sequence that holds one complete episode of the hardest difficulty."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line naming the task and its settings, for logs and tables."""
        return type(self).__name__

    def roles(self, labelled: Labelled) -> dict[str, Tensor] | None:
        """What each token is in its episode, as boolean masks (batch, length) by name, for a
        task whose labels put tokens of different jobs under one level; None where it names none.
        A label is the difficulty of predicting a token, but the work may happen earlier: on hops
        the chase can run where the hop count is read, a position whose target is a FORMAT '='."""
        return None


TASKS: Registry[Task] = Registry("task", "nag_lightning.tasks")


def build_task(name: str, **options) -> Task:
    """The registered task `name` with its options; an unknown name or option gets one sentence."""
    cls = TASKS.get(name)
    try:
        return cls(**options)
    except TypeError as error:
        raise ValueError(f"Task {name!r} does not take these options ({error}); see its docstring.") from None


def pack(tokens: Tensor, labels: Tensor, widths: Tensor, length: int, pad: int) -> Labelled:
    """Lay episodes end to end into rows of exactly `length` tokens.

    `tokens` and `labels` (n, E, W) hold E episodes per row, each padded to width W; `widths` (n, E)
    says how many of the W are the episode's own. An episode that would cross `length` is dropped
    with all after it, and the rest of the row is PAD (FORMAT), so every answer present has its
    whole question before it.
    """
    n, episodes, width = tokens.shape
    ends = widths.cumsum(1)  # (n, E) where each episode ends
    starts = ends - widths
    j = torch.arange(width).expand(n, episodes, width)
    keep = (j < widths[..., None]) & (ends[..., None] <= length)
    rows = torch.arange(n)[:, None, None].expand_as(j)[keep]
    cols = (starts[..., None] + j)[keep]
    out = torch.full((n, length), pad, dtype=torch.long)
    out_labels = torch.full((n, length), FORMAT, dtype=torch.long)
    out[rows, cols] = tokens[keep]
    out_labels[rows, cols] = labels[keep]
    return Labelled(out, out_labels)


for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("datamodule", "evaluation"):
        importlib.import_module(f"{__name__}.{_module.name}")
