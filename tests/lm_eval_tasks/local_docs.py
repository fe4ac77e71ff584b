"""The documents of the local test tasks, read from the JSONL beside this file (lm-eval imports
this module through the tasks' `custom_dataset`), so the tasks need no download."""

import json
from pathlib import Path

from datasets import Dataset, DatasetDict

HERE = Path(__file__).resolve().parent


def texts(**_) -> DatasetDict:
    """Python snippets, each a document whose bits per byte the rolling task measures; trailing
    spaces pad each to a multiple of 16 bytes (whole windows of a model of seq_len 16)."""
    return _split("texts.jsonl")


def choices(**_) -> DatasetDict:
    """Questions with choices of which one is right."""
    return _split("choices.jsonl")


def _split(name: str) -> DatasetDict:
    rows = [json.loads(line) for line in (HERE / name).read_text(encoding="utf-8").splitlines() if line]
    return DatasetDict({"test": Dataset.from_list(rows)})
