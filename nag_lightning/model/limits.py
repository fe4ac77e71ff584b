"""Whether this machine can hold the model an architecture describes, asked before anything is built.

Sizes come from configs, command lines, checkpoints and exported folders, and the last two may come
from anyone. A size the machine cannot hold fails late and badly when it is simply used: a model of
ten million blocks is built for hours, a width of a billion overflows torch's storage size or
dies in the allocator after the data was prepared. So `TransformerConfig` calls `check_size` before
it is used, which every reader of settings goes through; it allocates nothing and says, in one
sentence, which setting is too large, the bytes it came to and the limit.

The estimate (`needed_bytes`) is a lower bound in fp32: the weights (embedding, head, attention
and MLP of every block, the residual strategy's and routers' per-sublayer vectors), the rotary
tables, and the activations and KV entries of one sequence of `seq_len` tokens through every block.
Training holds more (gradients, optimizer state, a batch), so a model that passes may still not
train here; one that fails cannot even be built. The limit is the memory of this machine (or of
its container, where that is less), where the model is built before it moves to any device.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from nag_lightning.inputs import shorten

FP32 = 4
MAX_LAYERS = 1024
"""The most blocks a model may have. The deepest Transformers trained have about a thousand
layers (DeepNet, arXiv:2203.00555); building a model's modules takes seconds per thousand blocks
here, and time that grows faster than the depth beyond."""

SIZE_SETTINGS = ("d_model", "n_layers", "seq_len", "vocab_size", "mlp_ratio")
"""The settings the memory of a model grows with, named when it is too large."""
WHOLE_NUMBERS = ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len")


class TooLarge(ValueError):
    """A model this machine cannot hold: `problem`, then `advice` for a config or a command line;
    a reader of checkpoints says `problem` and `checkpoint_advice` instead."""

    def __init__(self, problem: str, advice: str, checkpoint_advice: str) -> None:
        super().__init__(f"{problem}; {advice}.")
        self.problem, self.checkpoint_advice = problem, checkpoint_advice


@dataclass(frozen=True)
class Sizes:
    """The settings of a `TransformerConfig` that its memory depends on."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    mlp_ratio: float


def needed_bytes(s: Sizes) -> int:
    """A lower bound of the bytes (fp32) that building the model and running one sequence need."""
    C, L, T, V = max(s.d_model, 1), max(s.n_layers, 1), max(s.seq_len, 1), max(s.vocab_size, 1)
    H = int(s.mlp_ratio * C)  # the MLP's hidden width, as TransformerConfig.mlp_hidden
    weights = 2 * V * C + L * (4 * C * C + 3 * C * H) + 8 * L * C  # + per-sublayer vectors
    rotary = T * (C // max(s.n_heads, 1))  # cos and sin, (T, D/2) each
    activations = L * T * (8 * C + 3 * H) + T * V  # q, k, v, outputs, MLP hidden; the logits
    return FP32 * (weights + rotary + activations)


def machine_memory() -> int:
    """Bytes of memory of this machine, or of the container it runs in where that is less."""
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): no machine limit
        return 2**62
    try:
        with open("/sys/fs/cgroup/memory.max") as handle:  # cgroup v2; "max" means none
            text = handle.read().strip()
        if text.isdigit():
            memory = min(memory, int(text))
    except OSError:
        pass
    return memory


def check_size(cfg, memory: int | None = None) -> None:
    """One sentence (ValueError) unless `cfg`'s sizes are whole numbers, a finite MLP ratio, at most
    MAX_LAYERS blocks and a model whose `needed_bytes` fit `memory` (default: `machine_memory`).
    Runs before the rest of `TransformerConfig`'s validation; it reads only numbers."""
    for name in WHOLE_NUMBERS:
        value = getattr(cfg, name)
        if type(value) is not int:  # a float, a string or a bool from a file
            raise ValueError(f"model.arch.{name} must be a whole number; got {shorten(repr(value))}.")
    ratio = cfg.mlp_ratio
    if type(ratio) not in (int, float) or not math.isfinite(ratio):
        raise ValueError(
            f"model.arch.mlp_ratio must be a finite positive number; got {shorten(repr(ratio))}."
        )
    if cfg.n_layers > MAX_LAYERS:
        raise TooLarge(
            f"model.arch.n_layers={cfg.n_layers:,} is more blocks than a model here may have "
            f"({MAX_LAYERS:,})",
            f"give at most {MAX_LAYERS:,}",
            f"give a checkpoint of a model of at most {MAX_LAYERS:,} blocks",
        )
    sizes = Sizes(**{name: getattr(cfg, name) for name in Sizes.__dataclass_fields__})
    need = needed_bytes(sizes)
    limit = machine_memory() if memory is None else memory
    if need <= limit:
        return
    name = _largest(sizes, need)
    raise TooLarge(
        f"model.arch.{name}={getattr(cfg, name):,} makes a model that needs at least {need:,} bytes "
        f"(fp32 weights and the activations of one sequence of {cfg.seq_len:,} tokens), more than "
        f"the {limit:,} bytes of memory this machine has",
        f"give a smaller model.arch.{name}, or run where there is more memory",
        "give a checkpoint of a smaller model, or run where there is more memory",
    )


def _largest(sizes: Sizes, need: int) -> str:
    """The setting of SIZE_SETTINGS whose reset to TransformerConfig's default saves the most."""
    defaults = Sizes(vocab_size=256, d_model=128, n_layers=4, n_heads=4, seq_len=256, mlp_ratio=4.0)

    def saved(name: str) -> int:
        value, default = getattr(sizes, name), getattr(defaults, name)
        smaller = {name: min(value, default)}
        if name == "d_model":  # keep the head width even and dividing d_model
            smaller["n_heads"] = min(sizes.n_heads, defaults.n_heads)
        return need - needed_bytes(Sizes(**{**sizes.__dict__, **smaller}))

    return max(SIZE_SETTINGS, key=saved)
