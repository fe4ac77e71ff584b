"""What a path given as a trained model is, decided once, before anything in it is read as weights.

    a file or a URL                                   CHECKPOINT  a .ckpt of `nag-lightning fit`
    a folder with .metadata                           CHECKPOINT  a sharded checkpoint, which the
                                                                  checkpoint reader refuses
    a folder whose config.json is this package's      EXPORT      `nag-lightning export`'s folder
    a folder whose config.json names a `model_type`   HF          a Hugging Face model folder
    any other folder                                  refused in one sentence

`nag_lightning.checkpoints.reader.read_saved` reads each kind; this module only tells them apart,
from config.json's keys (JSON, never code).
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path

from nag_lightning.checkpoints.exported import CONFIG, FORMAT


class SavedFormat(Enum):
    """The kinds of path `read_saved` takes."""

    CHECKPOINT = "checkpoint"
    EXPORT = "export"
    HF = "hf"


def saved_format(path: str | Path) -> SavedFormat:
    """The kind of `path` (see the module docstring); one sentence (ValueError) for a local folder
    that is neither a checkpoint nor an export."""
    if "://" in str(path) or not Path(path).is_dir() or (Path(path) / ".metadata").exists():
        return SavedFormat.CHECKPOINT  # the checkpoint reader says what is wrong with it, if anything
    config = Path(path) / CONFIG
    if not config.is_file():
        raise ValueError(
            f"The folder {path} is neither a checkpoint nor an export: it holds no {CONFIG}; give a "
            ".ckpt file from a run's checkpoints/ folder, or a folder written by `nag-lightning "
            "export` (config.json, model.safetensors, tokenizer.json)."
        )
    keys = _config_keys(config)
    if "model_type" in keys and "format" not in keys:
        return SavedFormat.HF
    # this package's export, or a damaged one: its reader says which setting is wrong
    return SavedFormat.EXPORT


def _config_keys(config: Path) -> set[str]:
    """The top-level keys of a config.json, or none when it is not a JSON object."""
    try:
        parsed = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError, OSError):
        return set()
    return set(parsed) if isinstance(parsed, dict) else set()


def hf_folder_not_read(path: str | Path) -> ValueError:
    """The sentence for a Hugging Face model folder, which the commands do not read (Python's
    `nag_lightning.load` does)."""
    return ValueError(
        f"The folder {path} is a Hugging Face model folder ({CONFIG} names a model_type, not "
        f"format: {FORMAT!r}), which the commands do not load; load it from Python with "
        "nag_lightning.load, or give a .ckpt file or a folder written by `nag-lightning export` "
        "in its native format."
    )
