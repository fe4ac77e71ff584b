"""A trained model evaluated on its own data: data module, batches, loss and routing.

What the sweep and the studies share. `evaluate` runs the model as it is set up (its routers at
their settings, or under `oracle.oracle`) and reads the counts of
`nag_lightning.model.flops`, so its MoD rate and FLOPs are the ones training logs.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from nag_lightning.analysis.sweeps.oracle import under_oracle
from nag_lightning.model import Transformer
from nag_lightning.model.flops import count_model

if TYPE_CHECKING:
    from nag_lightning.checkpoints.loading import LoadedModel

DATA_OPTIONS = ("source", "cache_dir", "batch_size", "max_bytes", "val_fraction", "tokenizer")
"""The data module settings a checkpoint's run is evaluated with again."""


def checkpoint_data(loaded: LoadedModel, use_saved_files: bool = False, **overrides):
    """A `TextDataModule` with the data settings the run of `loaded` (`load_model`'s) saved,
    `overrides` (not None) on top, prepared; one sentence if its tokenizer differs from the
    checkpoint's. A run on a synthetic task gets its task instead (`task_data`).

    Saved settings that name files (`saved_file_settings`) are untrusted: they are used only with
    `use_saved_files` (the user's --trust_checkpoint, or a study evaluating runs it trained), else
    refused in one sentence that shows them."""
    from nag_lightning.data import TextDataModule

    saved, tokenizer, seq_len = loaded.saved, loaded.tokenizer, loaded.model.cfg.seq_len
    if loaded.task is not None:
        return task_data(loaded, use_saved_files, **overrides)
    options = {k: v for k, v in saved.data.items() if k in DATA_OPTIONS}
    options.update({k: v for k, v in overrides.items() if v is not None})
    named = saved_file_settings(saved.data, overrides)
    if named and not use_saved_files:
        shown = ", ".join(f"{k}={v!r}" for k, v in named.items())
        flags = " and ".join(f"--{k}" for k in named if k != "tokenizer")
        raise ValueError(
            f"The checkpoint {saved.source} names files to read and write ({shown}), and a "
            "checkpoint may come from anyone; "
            + (f"give {flags} yourself (e.g. the values above, if they are yours), or " if flags else "")
            + "pass --trust_checkpoint to use the saved ones."
        )
    data = TextDataModule(seq_len=seq_len, **options)
    if data.tokenizer != tokenizer:
        raise ValueError(
            f"The checkpoint {saved.source} was trained on tokens of {tokenizer.describe()}, "
            f"but its data would now be tokenized with {data.tokenizer.describe()}; give the "
            "source and cache_dir it was trained with."
        )
    data.prepare_data()
    return data


TASK_OPTIONS = ("task", "task_options", "batch_size", "seed", "val_sequences", "epoch_batches", "file")
"""The settings of a `TaskDataModule` a checkpoint's run is evaluated with again."""


def task_data(loaded: LoadedModel, use_saved_files: bool = False, **overrides):
    """The `TaskDataModule` of a run on a synthetic task, with the settings it saved: its training
    stream and validation sequences as it saw them. Without this the run's saved settings, none of
    them a text option, would give the default `TextDataModule`, whose text the model never saw.
    Only `batch_size` may be overridden; a JSONL `file` is read only with `use_saved_files`."""
    from nag_lightning.tasks.datamodule import TaskDataModule

    saved = loaded.saved
    options = {k: v for k, v in saved.data.items() if k in TASK_OPTIONS}
    text = [f"--{k}" for k, v in overrides.items() if v is not None and k != "batch_size"]
    if text:
        raise ValueError(f"The checkpoint {saved.source} was trained on the task {options.get('task')!r}, "
                         f"which is evaluated on its own sequences: drop {', '.join(text)}, which name text.")
    if options.get("file") is not None and not use_saved_files:
        raise ValueError(f"The checkpoint {saved.source} names the task file {options['file']!r} to read, "
                         "and a checkpoint may come from anyone; pass --trust_checkpoint if it is yours.")
    if overrides.get("batch_size") is not None:
        options["batch_size"] = overrides["batch_size"]
    return TaskDataModule(seq_len=loaded.model.cfg.seq_len, **options)


def saved_file_settings(saved: dict, overrides: dict) -> dict:
    """The saved data settings that name files other than the defaults' and that `overrides` do
    not replace: the corpus (`source`), the folder written (`cache_dir`), a tokenizer.json path."""
    from nag_lightning.data import TextDataModule
    from nag_lightning.data.tokenizer import parse_spec

    defaults = {k: p.default for k, p in inspect.signature(TextDataModule.__init__).parameters.items()}
    named = {}
    for key in ("source", "cache_dir", "tokenizer"):
        value = saved.get(key, defaults[key])
        if overrides.get(key) is not None or value == defaults[key]:
            continue
        if key == "tokenizer" and isinstance(value, str) and parse_spec(value)[0] != "file":
            continue  # bytes or a BPE trained in cache_dir: no file of its own
        named[key] = value
    return named


def first_batches(loader: Iterable, n: int) -> list[Tensor]:
    """The first `n` batches of `loader` (fewer if it has fewer), as token ids (of a task's
    `Labelled` validation batches, the tokens)."""
    out = []
    for batch in loader:
        out.append(getattr(batch, "tokens", batch).long())
        if len(out) == n:
            break
    if not out:
        raise ValueError("The data module returned no batches; check the data options.")
    return out


@torch.no_grad()
def evaluate(model: Transformer, batches: list[Tensor], token_bytes: Tensor | None = None) -> dict:
    """Mean loss, bits per byte, MoD rate, executed forward FLOPs per token and the routers' mean
    `predictor_agreement` (None when no router reports one) over `batches`. `token_bytes` (the
    bytes each id stands for, `LanguageModel.token_bytes`) turns the loss into bits per byte;
    None: one byte per token."""
    device = next(model.parameters()).device
    nll = tokens = n_bytes = skipped = flops = 0.0
    agreement: list[float] = []
    for batch in batches:
        batch = batch.to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(inputs).logits
        nll += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").item()
        n_bytes += targets.numel() if token_bytes is None else token_bytes.to(device)[targets].sum().item()
        count = count_model(model, inputs.shape[1])
        tokens += count.tokens
        skipped += count.mod_rate * count.tokens  # every batch has one rate over its own tokens
        flops += count.forward
        if not under_oracle(model):  # the oracle asks no router
            agreement += [value for s in model.sublayers if s.routed
                          and (value := s.router.stats().get("predictor_agreement")) is not None]
    return {
        "val_loss": nll / tokens,
        "bpb": nll / n_bytes / math.log(2),
        "mod_rate": skipped / tokens,
        "flops_per_token": flops / tokens,
        "predictor_agreement": sum(agreement) / len(agreement) if agreement else None,
    }
