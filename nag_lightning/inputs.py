"""What every command's sentences about bad input share, below every other layer (it imports
nothing of the package): an echoed value cut to a readable length (`shorten`), and a folder a
command will write into, checked before it writes anything (`output_folder`).

A value a sentence echoes may come from a file someone else wrote (a checkpoint's tokenizer name,
a line of a task file), so it is cut, with its length said, rather than printed whole: an error of
five megabytes is no sentence.
"""

from __future__ import annotations

import os
from pathlib import Path

ECHO_LIMIT = 200
"""The most characters of a value an error message echoes (`shorten`)."""

MESSAGE_LIMIT = 2000
"""The most characters of a whole error message (`shorten_message`)."""


def shorten(text: object, limit: int = ECHO_LIMIT) -> str:
    """`text` (any value, as `str` writes it) as it is if it has at most `limit` characters, else its
    first `limit` followed by an ellipsis and its length: `'xxxx... (5,000,002 characters)`."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters)"


def shorten_message(message: str, limit: int = MESSAGE_LIMIT) -> str:
    """An error message of at most about `limit` characters, on one line: a longer one keeps its
    start (what is wrong) and its end (how to fix it), and says how much was left out between."""
    message = " ".join(message.splitlines()) if "\n" in message else message
    if len(message) <= limit:
        return message
    keep = limit // 2
    return f"{message[:keep]} [... {len(message) - 2 * keep:,} characters ...] {message[-keep:]}"


def output_folder(path: str | Path, option: str) -> Path:
    """`path`, a folder the command given `option` (its flag, e.g. `--out_dir`) will write into,
    checked before anything is computed or written (it is not created here): one sentence if it, or
    a folder above it, is a file, or if the nearest folder of it that exists is not writable."""
    folder = Path(path).expanduser()
    existing = next(p for p in (folder, *folder.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        where = "is a file" if existing == folder else f"lies under {shorten(existing)}, which is a file"
        raise ValueError(
            f"{option} {shorten(path)} {where}, not a folder; give a folder that is not inside a "
            "file (it is created if missing)."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(
            f"{option} {shorten(path)} cannot be written ({shorten(existing)} is not writable); give "
            "a folder you can write to."
        )
    return folder
