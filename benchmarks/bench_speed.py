"""CPU training-step speed, eager and under torch.compile, in one run: NAG over pre-norm at two
sizes, and how much of Mixture-of-Depths' FLOP saving shows up as step time.

    OMP_NUM_THREADS=1 python benchmarks/bench_speed.py               # every section, a few minutes
    OMP_NUM_THREADS=1 python benchmarks/bench_speed.py --sections mod --repeats 5

Sections (each runs its variants alternated step by step in this one process, in an order
shuffled every round, so drifts of the machine's load hit all alike, and reports medians; one
thread, `torch.set_num_threads(1)`):

    small   NAG and pre-norm, eager, d_model 128, 2 blocks, 4 heads; and NAG without its gated angle
            (the magnitude angle) or without its norm-lane readout, to show what each costs
    large   NAG and pre-norm, eager and compiled (inductor), d_model 256, 8 blocks, 8 heads
    mod     NAG unrouted, top-k (capacity 0.75) and threshold (target 25%) on every sublayer, eager
            and then compiled (each mode's models alternated in a phase of their own): the FLOPs
            saved (`nag_lightning.model.flops.count_model`, training = 3 x forward), the time
            saved, their ratio, and the graphs dynamo compiled after step 4
    write   one NAG write alone (the default gated angle, its gate included; batch x sequence
            rows, d_model 128 and 256), forward and forward + backward, the PyTorch reference
            against the write that inductor compiled, beside pre-norm's residual add and RMSNorm
            on the same rows

A training step is forward, backward and AdamW (`bench_residual_step.step`), sequence 256, batch 8.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import time

import torch
import torch.nn.functional as F
from bench_residual_step import build, step

from nag_kernels import gated_nag_write
from nag_lightning.model.compile import compile_model
from nag_lightning.model.flops import count_model

SIZES = {"small": dict(d_model=128, n_layers=2, n_heads=4), "large": dict(d_model=256, n_layers=8, n_heads=8)}
ROUTERS = {"unrouted": ("none", {}), "topk 0.75": ("topk", {"capacity": 0.75}),
           "threshold 25%": ("threshold", {"target_rate": 0.25, "warmup_steps": 0})}
SETTLED_STEP = 4  # no graph may be compiled after this many steps of each model
DIAGNOSTIC_VARIANTS = {"eager, magnitude angle (no gate)": '{"angle": "magnitude"}',
                       "eager, no norm-lane readout": '{"norm_lane_readout": false}'}
"""NAG without one part each, timed in the small section only: what that part costs."""


def step_args(
    args: argparse.Namespace, size: str, kernel: str = "auto", nag_options: str = "{}"
) -> argparse.Namespace:
    """Arguments in the shape `bench_residual_step.build/step` read."""
    return argparse.Namespace(device="cpu", seq_len=args.seq_len, kernel=kernel, nag_options=nag_options,
                              precision="32", **SIZES[size])


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (first compilations and recompilations)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def alternate(
    runs: dict, args: argparse.Namespace, size: str, after_step=None, after_round=None
) -> dict[str, list[float]]:
    """Seconds per step of every (model, optimizer) in `runs`, one step of each per round, in an
    order shuffled every round; the first `args.warmup` rounds (compilation included) untimed.
    `after_step(name, model, round)` runs after each step and `after_round(round)` after each
    round, outside the timing.

    Shuffled because a model's place in the round moves its step (the first one after another
    model's step pays for what that one left in the caches and the allocator; measured in
    docs/benchmarks.md, "Speed under torch.compile")."""
    settings = step_args(args, size)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=gen) for _ in range(4)]
    order = random.Random(0)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.warmup + args.repeats):
        order.shuffle(names)
        for name in names:
            model, optimizer = runs[name]
            start = time.perf_counter()
            step(model, optimizer, batches[i % len(batches)], settings)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
            if after_step is not None:
                after_step(name, model, i)
        if after_round is not None:
            after_round(i)
    return times


def residual_runs(args: argparse.Namespace, size: str, compiled: bool) -> dict:
    runs = {}
    for residual in ("prenorm", "nag"):
        runs[f"{residual} eager"] = build(residual, step_args(args, size))
        if compiled:
            model, optimizer = build(residual, step_args(args, size))
            runs[f"{residual} compiled"] = (compile_model(model), optimizer)
    # NAG's write as the PyTorch reference's separate operations, where eager NAG compiles it
    runs["nag eager, reference write"] = build("nag", step_args(args, size, kernel="torch"))
    if not compiled:  # where the rest of the small model's gap goes: NAG without one of its parts
        for mode, options in DIAGNOSTIC_VARIANTS.items():
            runs[f"nag {mode}"] = build("nag", step_args(args, size, nag_options=options))
    return runs


def residual_section(args: argparse.Namespace, size: str, compiled: bool) -> None:
    times = alternate(residual_runs(args, size, compiled), args, size)
    median = {name: statistics.median(t) for name, t in times.items()}
    s = SIZES[size]
    print(f"\n{size}: d_model {s['d_model']}, {s['n_layers']} blocks, {s['n_heads']} heads; median of "
          f"{args.repeats} steps after {args.warmup}\n")
    print("| mode | pre-norm step (ms) | NAG step (ms) | NAG / pre-norm |")
    print("|---|---|---|---|")
    for mode in ("eager", "eager, reference write", *DIAGNOSTIC_VARIANTS, "compiled"):
        if f"nag {mode}" in median:
            pre = median[f"prenorm {mode.split(',')[0]}"]
            nag = median[f"nag {mode}"]
            print(f"| {mode} | {1000 * pre:.1f} | {1000 * nag:.1f} | {nag / pre:.3f} |")


def mod_section(args: argparse.Namespace) -> None:
    """Unrouted, top-k and threshold NAG, eager and then compiled: each mode's three models alternate
    in a phase of their own, and the other mode's models are freed first, because a model's step
    moves with what else the process holds: held beside the compiled models, the eager unrouted
    model ran slower than the same model in the large section (docs/benchmarks.md)."""
    settings = step_args(args, "large")
    times: dict[str, list[float]] = {}
    flops: dict[str, list[float]] = {}
    rates: dict[str, list[float]] = {}
    graphs: dict[str, int] = {}

    def settled(i):
        if i == SETTLED_STEP - 1:
            graphs["settled"] = graphs_compiled()  # every model of the phase has run SETTLED_STEP steps

    def count(name, model, i):
        if i >= args.warmup:
            counted = count_model(model, args.seq_len)
            flops[name].append(3 * counted.forward)
            rates[name].append(counted.mod_rate)

    late = 0
    for mode in ("eager", "compiled"):
        runs = {}
        for name, (router, options) in ROUTERS.items():
            model, optimizer = build("nag", settings, router=router, router_options=options)
            runs[f"{name} {mode}"] = (compile_model(model) if mode == "compiled" else model, optimizer)
        flops.update({name: [] for name in runs})
        rates.update({name: [] for name in runs})
        times.update(alternate(runs, args, "large", count, settled))
        late += graphs_compiled() - graphs.pop("settled", 0)
        del runs, model, optimizer  # the next phase's models run without these beside them
        gc.collect()
    print(f"\nmod: NAG, d_model 256, 8 blocks, 8 heads, every sublayer routed; median of {args.repeats} "
          f"steps after {args.warmup}, eager then compiled; graphs compiled after step {SETTLED_STEP}: "
          f"{late} (of {graphs_compiled()} in all)\n")
    print("| mode | configuration | MoD rate | training GFLOP/step | step (ms) | FLOPs saved | time saved "
          "| time saved / FLOPs saved |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("eager", "compiled"):
        t0, f0 = (statistics.median(x[f"unrouted {mode}"]) for x in (times, flops))
        for name in ROUTERS:
            t, f = (statistics.median(x[f"{name} {mode}"]) for x in (times, flops))
            saved_t, saved_f = 1 - t / t0, 1 - f / f0
            share = f"{saved_t / saved_f:.0%}" if saved_f > 0 else "-"
            print(f"| {mode} | {name} | {statistics.mean(rates[f'{name} {mode}']):.1%} | {f / 1e9:.1f} | "
                  f"{1000 * t:.0f} | {saved_f:.1%} | {saved_t:.1%} | {share} |")


def nag_write_call(tensors: tuple, grad: torch.Tensor, theta_max: float, backend: str, backward: bool):
    """One gated NAG write of `tensors` (u, f, rho, gate_w, gate_b, alpha, beta), its angle from
    the gate included, by `backend`, as a call; with `backward` it also runs the backward of
    (u', rho') with gradients (grad, 1)."""
    leaves = [t.clone().requires_grad_(backward) for t in tensors]

    def run() -> None:
        u, f, rho, gate_w, gate_b, alpha, beta = leaves
        gain = math.sqrt(u.shape[-1])
        u_new, rho_new, _, _ = gated_nag_write(u, f, rho, None, alpha, beta, theta_max, gate_w, gate_b, gain,
                                               backend=backend)
        if backward:
            torch.autograd.backward((u_new, rho_new), (grad, torch.ones_like(rho_new)))
            for leaf in leaves:
                leaf.grad = None  # each call's gradients are new tensors, not sums

    return run


def prenorm_write_call(tensors: tuple, grad: torch.Tensor, backward: bool):
    """Pre-norm's residual add and the next RMSNorm on `tensors` (x, f, gamma), as a call."""
    leaves = [t.clone().requires_grad_(backward) for t in tensors]

    def run() -> None:
        x, f, gamma = leaves
        h = F.rms_norm(x + f, gamma.shape, gamma)
        if backward:
            h.backward(grad)
            for leaf in leaves:
                leaf.grad = None

    return run


def write_section(args: argparse.Namespace) -> None:
    theta_max = math.pi / 2
    print(f"\nwrite: one write over {args.batch} x {args.seq_len} rows; median of {10 * args.repeats} "
          "calls after 5 (the compiled functions compile in the first)\n")
    print("| d_model | pass | pre-norm add + RMSNorm (ms) | NAG write, reference (ms) "
          "| NAG write, compiled (ms) | compiled / reference |")
    print("|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for d in (128, 256):
        rows = (args.batch, args.seq_len)
        u = F.normalize(torch.randn(*rows, d, generator=gen), dim=-1)
        f, x = torch.randn(*rows, d, generator=gen), torch.randn(*rows, d, generator=gen)
        rho, gate_w = torch.zeros(rows), torch.randn(d, generator=gen) / d
        nag_tensors = (u, f, rho, gate_w, torch.tensor(0.0), torch.tensor(1.0), torch.tensor(0.5))
        grad = torch.randn(*rows, d, generator=gen)
        for backward in (False, True):
            calls = {"prenorm": prenorm_write_call((x, f, torch.ones(d)), grad, backward),
                     "torch": nag_write_call(nag_tensors, grad, theta_max, "torch", backward),
                     "inductor": nag_write_call(nag_tensors, grad, theta_max, "inductor", backward)}
            times = {name: [] for name in calls}
            for i in range(5 + 10 * args.repeats):
                for name, call in calls.items():
                    start = time.perf_counter()
                    call()
                    if i >= 5:
                        times[name].append(time.perf_counter() - start)
            pre, ref, fused = (1000 * statistics.median(times[n]) for n in ("prenorm", "torch", "inductor"))
            which = "forward + backward" if backward else "forward"
            print(f"| {d} | {which} | {pre:.3f} | {ref:.3f} | {fused:.3f} | {fused / ref:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", choices=("small", "large", "mod", "write"),
                        default=["small", "large", "mod", "write"])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=8, help="timed steps of each variant")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps of each variant (compiles)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread; sequence {args.seq_len}, "
          f"batch {args.batch}")
    if "small" in args.sections:
        residual_section(args, "small", compiled=False)
    if "large" in args.sections:
        residual_section(args, "large", compiled=True)
    if "mod" in args.sections:
        mod_section(args)
    if "write" in args.sections:
        write_section(args)


if __name__ == "__main__":
    main()
