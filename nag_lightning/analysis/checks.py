"""Checks of the options the commands around training share (device, seed, counts), each refusing
a bad value with one sentence that names the option, before a checkpoint is read."""

from __future__ import annotations

from collections.abc import Sized

import torch

DEVICE_TYPES = ("cpu", "cuda", "mps")
SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes 0 .. 2**64 - 1


def check_device(device: str) -> None:
    """Refuse a device torch does not know, or one this machine does not have."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in DEVICE_TYPES:
        raise ValueError(f"--device {device!r} is not a device to run on; give cpu, cuda, cuda:N or mps.")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {device} needs a CUDA GPU, and torch finds none on this "
                             "machine; use --device cpu.")
        if parsed.index is not None and parsed.index >= count:
            raise ValueError(f"--device {device} names GPU {parsed.index}, but this machine has "
                             f"{count} (cuda:0 to cuda:{count - 1}); name one of those.")
    if parsed.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"--device {device} needs Apple's Metal (MPS), which this machine does not "
                         "offer; use --device cpu.")


def check_seed(seed: int, option: str = "--seed") -> None:
    """Refuse a seed the random generators cannot take."""
    if not 0 <= seed < SEED_LIMIT:
        raise ValueError(f"{option}={seed} is outside the seeds torch takes, 0 to 2**64 - 1; give "
                         "one in that range.")


def check_at_least_one(**options: int) -> None:
    """Refuse a count below 1 (a count of batches of 0 would not mean "none" but "all")."""
    for name, value in options.items():
        if value < 1:
            raise ValueError(f"--{name}={value} is not a count; give a number of at least 1.")


def check_not_empty(**options: Sized | None) -> None:
    """Refuse an empty list given for an option (None: left out, which has its default)."""
    for name, value in options.items():
        if value is not None and len(value) == 0:
            raise ValueError(f"--{name} is an empty list; give at least one value, or leave "
                             f"--{name} out for its default.")
