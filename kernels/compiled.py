"""The NAG write compiled by inductor, for eager training where the Triton kernel does not run.

In eager mode PyTorch runs the reference write as about thirty separate passes over the (rows, d)
tensors, forward and backward, where pre-norm's residual add and norm take four: on CPU that was
5-13% of a training step (docs/benchmarks.md). No eager PyTorch operation fuses them, so here
inductor compiles the reference's forward and `reference_backward`'s formulas, each as a function
of its own (traced with symbolic sizes: one compilation serves every batch and sequence length),
into a few fused loops; the gated NAG's write (`gated.py`) compiles its angle's formulas with
them. The model itself stays eager; only these functions are compiled, and they are called
without dynamo (`_Variant`): at a write's sizes its per-call work was a tenth of the write.
Numbers that differ from sublayer to sublayer (a sublayer's bound) are passed as tensors, so one
compilation serves every sublayer.

Compiling takes seconds to a minute (importing the compiler, tracing, inductor's build; its
on-disk cache makes later processes faster), which a training run should not wait for. So
`nag_kernels.nag_write`'s `auto` compiles in a background thread (`call(..., wait=False)`) and
runs the reference until the compiled write is ready: the first step starts as soon as pre-norm's
would. The two compute the same functions and differ only in rounding, so a run's rounding changes
at the step the compiled write arrives; `kernel: inductor` compiles before the first write instead
(`wait=True`), and `kernel: torch` never compiles. `auto` takes this path only for writes of at
least `MIN_ELEMENTS` elements, or smaller ones in a training run long enough to repay the
compilation (`MIN_RUN_ELEMENTS`); tests and small runs keep the reference. Where compiling fails
(no C++ compiler, an unsupported platform), the failure is reported once and every later write
runs the reference.
"""

from __future__ import annotations

import inspect
import queue
import threading
import time
import warnings
from collections.abc import Callable

import torch

MIN_ELEMENTS = 1 << 19
"""Writes of fewer elements (rows x d) run the reference, unless a training run long enough to
repay the compilation is under way (`MIN_RUN_ELEMENTS`): compiling costs about 30 s of CPU with a
cold cache, and below this size the fused write saves too little per step to repay it in a run
of the package's CPU recipes (the quickstart's 2048 rows of 128: about 5% of a 600-step run's
steps, some 7 s; docs/benchmarks.md, "What a user waits for first")."""

MIN_RUN_ELEMENTS = 1 << 28
"""During a training run of known length (`expect_training_steps`), a smaller write compiles too
where its elements times the run's remaining steps reach this. The hops recipes write 2048 rows of
64 for 3000 steps (3.9e8): there the compiled write, forward and backward, takes about 1.6 ms
against the reference's 4.1, some 40 ms of a step at 8 blocks and two minutes of a run, against
the compilation's 30 s of CPU. The quickstart's 600 steps of 2048 rows of 128 (1.6e8) stay below."""

_training_steps: float | None = None
"""The steps the training run in this process has left (`expect_training_steps`); None: none."""


def expect_training_steps(steps: float | None) -> None:
    """Tell `auto` that a training run of `steps` more steps (inf: no end known) starts in this
    process, or with None that it ended: long runs compile smaller writes (`MIN_RUN_ELEMENTS`).
    NAG's training runs call it when training starts and ends (`nag_lightning.callbacks.RunLength`)."""
    global _training_steps
    if steps is not None and not steps >= 0:
        raise ValueError(f"steps must be a number of steps >= 0 or None; got {steps!r}.")
    _training_steps = steps

INDUCTOR_OPTIONS = {"realize_reads_threshold": 1}
"""Store every per-row number that a full-width loop reads (an angle, its sine and cosine, a norm)
in a buffer of its own, computed once per row in a loop vectorized over rows, instead of inlining
it into the (rows, d) loops, which recompute such scalars for every vector of the row: the
forward and backward at (2048, 128) took 0.54 and 0.60 ms with inductor's default (4), 0.51 and
0.48 with this."""

MAX_VARIANTS = 8
"""Variants compiled per function and setting (a dimension of 1, other strides); a function
called in more shapes than that runs uncompiled in the others."""

_compiled: dict[tuple, list[_Variant]] = {}
_pending: set[tuple] = set()
"""Settings whose next variant the background thread is compiling."""
_failed = False
_lock = threading.Lock()  # one compilation at a time, in whichever thread asked for it
_queue: queue.SimpleQueue | None = None


def usable(u: torch.Tensor, pass_elements: int | None = None) -> bool:
    """Whether a write of `u` (eager, on CPU, in fp32/bf16, large enough) takes the compiled path.
    Large enough is the size of the model's full write, `pass_elements` where given (a routed
    write of a few of a pass's rows runs as the pass's other writes do), else u's: at least
    `MIN_ELEMENTS`, or `MIN_RUN_ELEMENTS` over the steps a training run under way has left."""
    return (
        # first: a compiled model fuses the traced write itself, and a routed one's row count is
        # a data-dependent size that the size test below would break the graph on
        not torch.compiler.is_compiling()
        and not _failed
        and u.device.type == "cpu"
        and u.dtype in (torch.float32, torch.bfloat16)
        and _repays(u.numel() if pass_elements is None else pass_elements)
    )


def _repays(elements: int) -> bool:
    """Whether compiling a write of `elements` pays: a large write, or a long training run."""
    if elements >= MIN_ELEMENTS:
        return True
    return _training_steps is not None and elements * _training_steps >= MIN_RUN_ELEMENTS


class _Variant:
    """One function compiled for one setting (its non-tensor arguments), its tensors' dtypes and
    dimensions, and the sizes and strides `accepts` admits.

    Traced with symbolic sizes (`make_fx`) and compiled by `torch._inductor.standalone_compile`,
    it is called directly: no dynamo frame, guard tree or runtime wrappers, whose fixed cost per
    call was a sizeable share of a write at a model's sizes (docs/benchmarks.md). What dynamo's
    guards would check, `accepts` checks: the tracing's conditions on the sizes and strides
    (sizes that must agree, contiguous strides, a dimension traced as 1 or as more), in torch's
    own expression of them."""

    def __init__(self, fn: Callable, values: tuple, names: tuple[str, ...]) -> None:
        # imported here: importing the package does not import the compiler
        import torch.fx.experimental._config as fx_config
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        slots = [i for i, value in enumerate(values) if isinstance(value, torch.Tensor)]
        template = [None if i in slots else value for i, value in enumerate(values)]  # holds no tensor
        positional = len(values) - len(names)
        self.structure = None

        def flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
            given = list(template)
            for slot, tensor in zip(slots, tensors):
                given[slot] = tensor
            outs: list[torch.Tensor] = []
            self.structure = _structure(fn(*given[:positional], **dict(zip(names, given[positional:]))), outs)
            return outs

        # make_fx makes one input of each parameter the signature names, and none of *tensors
        flat.__signature__ = inspect.Signature(
            [inspect.Parameter(f"t{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD) for i in range(len(slots))]
        )
        # Where a tensor starts in its storage (one layer's row of a parameter) does not matter:
        # the compiled code reads each input from its data pointer. So the tracing sees stand-ins
        # of the same sizes and strides at offset 0, and the offsets' conditions are dropped below;
        # kept, each layer's row of alpha, beta and the gate would compile a variant of its own.
        tensors = [
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
            for t in (values[i] for i in slots)
        ]
        # equal sizes stay separate symbols unless the formulas need them equal
        with fx_config.patch(use_duck_shape=False):
            graph = make_fx(flat, tracing_mode="symbolic")(*tensors)
        inputs = [node.meta["val"] for node in graph.graph.nodes if node.op == "placeholder"]
        shape_env = next(t.fake_mode.shape_env for t in inputs if isinstance(t, torch.Tensor))
        condition = shape_env.produce_guards_expression(inputs, ignore_static=False) or "True"
        terms = condition.split(" and ")
        if all(term.count("(") == term.count(")") for term in terms):  # a conjunction of whole terms
            condition = " and ".join(term for term in terms if "storage_offset()" not in term) or "True"
        # evaluated as `ShapeEnv.evaluate_guards_expression` does, over inputs named t0, t1, ... in L
        self.accepts = eval(f"lambda L: {condition}", dict(SYMPY_INTERP))  # noqa: S307
        self.run = torch._inductor.standalone_compile(
            graph, tensors, dynamic_shapes="from_graph", options={"config_patches": INDUCTOR_OPTIONS}
        )

    def __call__(self, tensors: list[torch.Tensor]):
        return _rebuild(self.structure, self.run(*tensors))


def _structure(value, tensors: list[torch.Tensor]):
    """`value` (tensors in nested tuples, None and constants) with each tensor appended to
    `tensors` and replaced by its index there, a `_Slot`. Not `torch.utils._pytree`: its flatten
    and unflatten took a third of a small call's time."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, tuple | list):
        return tuple(_structure(v, tensors) for v in value)
    return value


def _rebuild(structure, tensors: list[torch.Tensor]):
    if isinstance(structure, _Slot):
        return tensors[structure]
    if isinstance(structure, tuple):
        return tuple(_rebuild(s, tensors) for s in structure)
    return structure


class _Slot(int):
    """An output tensor's index among the compiled function's outputs."""


def call(fn: Callable, *args, wait: bool = True, **kwargs):
    """Run `fn` (a write's forward or backward formulas: `nag_write_reference`,
    `nag_write_reference_backward`, or the gated write's in `gated.py`) compiled: once per setting
    and shape variant, so importing the package does not import the compiler. With `wait` the
    first call compiles before it returns; without, it asks the background thread to compile and
    runs `fn` as written until the compiled variant is ready. On a compilation failure, warn once
    and run every function as written from then on. Its tensors must not need gradients (the
    compiled code records no autograd graph); its arguments are tensors, None and constants, its
    outputs tensors, None and constants in tuples."""
    if _failed:
        return fn(*args, **kwargs)
    values = (*args, *kwargs.values())
    tensors = [value for value in values if isinstance(value, torch.Tensor)]
    setting = (fn, tuple(kwargs), *(
        (v.dtype, v.device, v.dim()) if isinstance(v, torch.Tensor) else v for v in values
    ))  # fmt: skip
    variants = _compiled.setdefault(setting, [])
    given = {f"t{i}": tensor for i, tensor in enumerate(tensors)}
    for variant in variants:
        if variant.accepts(given):
            return variant(tensors)
    if len(variants) >= MAX_VARIANTS or setting in _pending:
        return fn(*args, **kwargs)
    if not wait:
        _pending.add(setting)
        _background().put((setting, fn, _stand_ins(values), tuple(kwargs)))
        return fn(*args, **kwargs)
    variant = _compile(setting, fn, values, tuple(kwargs))
    return fn(*args, **kwargs) if variant is None else variant(tensors)


def wait_until_compiled(timeout: float = 600.0) -> bool:
    """Block until the background thread has compiled every write asked of it (at most `timeout`
    seconds); whether it has. For benchmarks, which time the compiled write, not the reference."""
    deadline = time.monotonic() + timeout
    while _pending and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _pending


def _compile(setting: tuple, fn: Callable, values: tuple, names: tuple[str, ...]) -> _Variant | None:
    """Compile `fn` for `values` and keep the variant under `setting`; None (and the reference from
    now on, with one warning) where compiling fails."""
    global _failed
    try:
        with _lock:
            variant = _Variant(fn, values, names)
        _compiled[setting].append(variant)
        return variant
    except Exception as error:  # noqa: BLE001  (any compiler failure: the reference is exact)
        _failed = True
        warnings.warn(
            f"The NAG write could not be compiled for CPU ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}); it runs the PyTorch reference "
            "from now on, at the same values but slower. Install a C++ compiler (g++ or clang++) "
            "to get the fused write, or pass kernel='torch' to silence this.",
            stacklevel=4,
        )
        return None


def _stand_ins(values: tuple) -> tuple:
    """`values` with each tensor replaced by an uninitialised one of the same dtype, sizes and
    strides: what tracing needs, without keeping the step's tensors alive in the queue."""
    return tuple(
        torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
        if isinstance(v, torch.Tensor) else v
        for v in values
    )  # fmt: skip


def _background() -> queue.SimpleQueue:
    """The queue of the thread that compiles for `call(..., wait=False)`, started on first use. A
    daemon: a process that ends while it compiles does not wait for it."""
    global _queue
    if _queue is None:
        _queue = queue.SimpleQueue()
        threading.Thread(target=_compile_queued, args=(_queue,), name="nag-write-compile",
                         daemon=True).start()
    return _queue


def _compile_queued(work: queue.SimpleQueue) -> None:
    while True:
        setting, fn, values, names = work.get()
        try:
            if not _failed:
                _compile(setting, fn, values, names)
        finally:
            _pending.discard(setting)
