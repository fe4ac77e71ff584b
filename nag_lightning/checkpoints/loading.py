"""A trained model ready to run, from a checkpoint or an exported folder, in one pass.

    path ─> read_saved: which kind of path it is (`formats`), the one read (weights_only=True,
            `trust`; JSON and safetensors for a folder, `exported`), its contents, finite weights
            and Lightning release (`values`), earlier formats brought up to date (`compat`)
         ─> the plugins its settings name: registries only, unless trusted (`trust`)
         ─> its tokenizer, checked against the model's vocabulary
         ─> its Transformer: the settings in the current layout (`settings`), the weights' sizes
            and the plugins' saved settings checked on the meta device, then loaded
         ─> LoadedModel: the model in eval mode on its device, its tokenizer, the task it trained on

Everything that runs a trained model starts here: the LightningModule (`LanguageModel.from_saved`),
the commands (`generate`, `sweep`, `eval`, `export`, `depth-map`), the studies and
`nag_lightning.load`; none of them reads or checks the file again. Building the model needs no
Lightning, so a command that only runs it starts at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from nag_lightning.checkpoints.reader import SavedCheckpoint, fitting_weights, read_saved
from nag_lightning.checkpoints.settings import check_architecture
from nag_lightning.data.tokenizer import BYTES, Tokenizer
from nag_lightning.model import Transformer, TransformerConfig

TASK_DATA = ".TaskDataModule"
"""How a run on a synthetic task names its data module (the end of its saved class path)."""


@dataclass(frozen=True)
class SavedTask:
    """The synthetic task a run trained on, as its data settings name it.

    Attributes:
        name: the registered task ("hops", "state"), or the task file's path.
        options: the task's keyword options (empty for a file).
        from_file: whether the run read labelled sequences from a JSONL file rather than a task.
    """

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    from_file: bool = False


@dataclass(eq=False)
class LoadedModel:
    """A trained model, checked and ready to run.

    Attributes:
        model: the `Transformer`, in eval mode on the device it was loaded to.
        tokenizer: its tokenizer, every id of which the model embeds.
        saved: the checkpoint as read, for what else it holds (data settings, step).
    """

    model: Transformer
    tokenizer: Tokenizer
    saved: SavedCheckpoint

    @property
    def source(self) -> str:
        """The path or address the model was loaded from."""
        return self.saved.source

    @property
    def token_bytes(self) -> Tensor | None:
        """The bytes each token id stands for (vocab,) on the model's device; None for bytes."""
        return token_byte_lengths(self.tokenizer, self.model.cfg.vocab_size, self.model.head.weight.device)

    @property
    def task(self) -> SavedTask | None:
        """The synthetic task the run trained on, or None for a run on text."""
        data = self.saved.data
        if not str(data.get("_class_path", "")).endswith(TASK_DATA):
            return None
        if data.get("file") is not None:
            return SavedTask(str(data["file"]), {}, from_file=True)
        return SavedTask(str(data.get("task", "hops")), dict(data.get("task_options") or {}))


def load_model(
    path: str | Path | SavedCheckpoint,
    device: str | torch.device = "cpu",
    trust_checkpoint: bool = False,
    arch: TransformerConfig | Mapping[str, Any] | None = None,
    replaced: Iterable[str] = (),
) -> LoadedModel:
    """The model at `path` (a .ckpt file or URL, a folder of `nag-lightning export`, or a checkpoint
    already read), every check done, in eval mode on `device`; one sentence (ValueError,
    FileNotFoundError) for anything that is not a model this package trained.

    Args:
        path: where the model is, or the `SavedCheckpoint` a command has read already.
        device: where the model runs.
        trust_checkpoint: let a residual or router named by a class path outside the registered
            plugins be imported and built; only for checkpoints whose origin you trust.
        arch: the caller's own architecture to build instead of the saved one (a resumed run's
            settings); refused in one sentence where the weights depend on a setting it changes.
        replaced: saved settings the caller overrides, which are therefore never built.
    """
    saved = path if isinstance(path, SavedCheckpoint) else read_saved(path)
    own = None if arch is None else (asdict(arch) if isinstance(arch, TransformerConfig) else dict(arch))
    saved.check_plugins(trust_checkpoint, None if own is None else {"arch": own}, replaced)
    if own is not None:
        check_architecture(saved.hyper_parameters, own, saved.source)
    settings = saved.arch if own is None else own
    tokenizer = saved.tokenizer  # its ids fit the saved vocabulary
    saved.check_weights(settings)  # on the meta device: nothing is allocated for settings that do not fit
    model = Transformer(TransformerConfig(**settings))
    if model.cfg.vocab_size > tokenizer.vocab_size:  # `fit` makes them equal
        raise ValueError(
            f"The checkpoint {saved.source} holds a model of {model.cfg.vocab_size} token ids but a "
            f"tokenizer of {tokenizer.vocab_size}, which cannot decode the others; give a "
            "checkpoint written by `nag-lightning fit`, whose tokenizer fits its model."
        )
    weights = saved.model_weights
    with fitting_weights(model.state_dict(), weights, saved.source):
        model.load_state_dict(weights)
    return LoadedModel(model.to(device).eval(), tokenizer, saved)


def token_byte_lengths(
    tokenizer: Tokenizer, vocab_size: int, device: str | torch.device = "cpu"
) -> Tensor | None:
    """The bytes each of `vocab_size` ids stands for under `tokenizer` (0 for ids beyond it), which
    turn a loss per token into bits per byte; None for bytes, where every id is one byte."""
    if tokenizer.key == BYTES:
        return None
    lengths = torch.zeros(max(vocab_size, tokenizer.vocab_size), dtype=torch.long)
    lengths[: tokenizer.vocab_size] = tokenizer.byte_lengths
    return lengths.to(device)
