"""What the data modules ask of files and folders: is a file text, is a source remote, does a
folder hold a litdata dataset, and one sentence when a cache folder cannot be written or an object
store cannot be read."""

from __future__ import annotations

import json
from pathlib import Path

# Marks cache_dir as a cache (https://bford.info/cachedir/): corpus scans and backups skip it.
CACHEDIR_TAG = "CACHEDIR.TAG"
CACHEDIR_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55\n# nag-lightning token cache\n"


def is_text(path: Path) -> bool:
    """A file is text unless its first 8 KiB hold a NUL byte (the rule git and grep use)."""
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def is_remote(source: str) -> bool:
    return "://" in source


def is_litdata(folder: Path) -> bool:
    """Whether `folder` holds a litdata index (and not just any file named index.json)."""
    try:
        index = json.loads((folder / "index.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(index, dict) and {"chunks", "config"} <= index.keys()


def unwritable(cache_dir: str | Path, error: OSError) -> ValueError:
    if Path(cache_dir).expanduser().is_file():
        return ValueError(
            f"data.cache_dir={str(cache_dir)!r} is a file, not a folder; give a folder for the "
            "token cache (it is created if missing)."
        )
    return ValueError(
        f"data.cache_dir={str(cache_dir)!r} cannot hold the token cache ({error.strerror or error}: "
        f"{error.filename or cache_dir}); give a folder you can write to."
    )


def unreachable(root: str, error: Exception) -> ValueError:
    """One sentence for an object-store dataset that could not be opened."""
    if "Credential" in type(error).__name__:  # botocore's NoCredentialsError and its kin
        return ValueError(
            f"No credentials were found to read data.source {root!r}; configure them (e.g. "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE or `aws configure` for "
            "s3://) or copy the data to a local folder and give that."
        )
    return ValueError(
        f"data.source {root!r} could not be opened ({type(error).__name__}: {error}); check the "
        "address, your network and your access to it, or copy the data to a local folder."
    )
