"""The NAG write compiled by inductor, for eager training where the Triton kernel does not run.

In eager mode PyTorch runs the reference write as about thirty separate passes over the (rows, d)
tensors, forward and backward, where pre-norm's residual add and norm take four: on CPU that was
5-13% of a training step (docs/benchmarks.md). No eager PyTorch operation fuses them, so here
inductor compiles the reference's forward and `reference_backward`'s formulas, each as a function
of its own (`dynamic=True`: one compilation serves every batch and sequence length), into a few
fused loops; the gated NAG's write (`gated.py`) compiles its angle's formulas with them. The
model itself stays eager; only these functions are compiled.

The first call in a process compiles (about half a minute with a cold cache, a few seconds with
inductor's on-disk cache warm), so `nag_kernels.nag_write` takes this path only for writes of at
least `MIN_ELEMENTS` elements, where a training run is long enough to repay it; tests and small
runs keep the reference. Where compiling fails (no C++ compiler, an unsupported platform), the
failure is reported once and every later write runs the reference: values and gradients are the
same functions' either way, only their rounding differs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

MIN_ELEMENTS = 1 << 16
"""Writes of fewer elements (rows x d) run the reference: below it, a model trains too briefly
for the one-time compilation to pay."""

INDUCTOR_OPTIONS = {"realize_reads_threshold": 1}
"""Store every per-row number that a full-width loop reads (an angle, its sine and cosine, a norm)
in a buffer of its own, computed once per row in a loop vectorized over rows, instead of inlining
it into the (rows, d) loops, which recompute such scalars for every vector of the row: the
forward and backward at (2048, 128) took 0.54 and 0.60 ms with inductor's default (4), 0.51 and
0.48 with this."""

_compiled: dict[Callable, Callable] = {}
_failed = False


def usable(u: torch.Tensor) -> bool:
    """Whether a write of `u` (eager, on CPU, in fp32/bf16, large enough) takes the compiled path."""
    return (
        # first: a compiled model fuses the traced write itself, and a routed one's row count is
        # a data-dependent size that the size test below would break the graph on
        not torch.compiler.is_compiling()
        and not _failed
        and u.device.type == "cpu"
        and u.dtype in (torch.float32, torch.bfloat16)
        and u.numel() >= MIN_ELEMENTS
    )


def call(fn: Callable, *args, **kwargs):
    """Run `fn` (a write's forward or backward formulas: `nag_write_reference`,
    `nag_write_reference_backward`, or the gated write's in `gated.py`) compiled, each function
    once, on first use, so importing the package does not import the compiler; on a compilation
    failure, warn once and run every function as written from then on."""
    global _failed
    if not _failed:
        try:
            if fn not in _compiled:
                _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True, options=INDUCTOR_OPTIONS)
            return _compiled[fn](*args, **kwargs)
        except Exception as error:  # noqa: BLE001  (any compiler failure: the reference is exact)
            _failed = True
            warnings.warn(
                f"The NAG write could not be compiled for CPU ({type(error).__name__}: "
                f"{str(error).splitlines()[0] if str(error) else ''}); it runs the PyTorch reference "
                "from now on, at the same values but slower. Install a C++ compiler (g++ or clang++) "
                "to get the fused write, or pass kernel='torch' to silence this.",
                stacklevel=3,
            )
    return fn(*args, **kwargs)
