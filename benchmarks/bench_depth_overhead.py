"""How much of a deep, narrow model's training step is per-sublayer overhead rather than arithmetic.

    OMP_NUM_THREADS=1 python benchmarks/bench_depth_overhead.py            # 32 blocks, width 64
    OMP_NUM_THREADS=1 python benchmarks/bench_depth_overhead.py --repeats 8 --ops 8   # and where the time goes

Each residual's step (forward, backward, AdamW, as `bench_residual_step.py` times it) is timed at
the given shape and at a tiny one (1 sequence of 8 tokens), the models alternated step by step and
the medians reported. At the tiny shape the arithmetic is negligible and what is left is the cost
every step pays whatever its size: Python, operator dispatch, autograd bookkeeping and the
optimizer's per-parameter work. Times are the process's CPU time, which a loaded machine inflates
less than wall-clock time. Then one profiled step per residual at the given shape (cProfile): the
share of the step spent in Python frames themselves (every function's own time, less the C
functions that do the arithmetic), an upper bound, since the profiler adds a cost to every Python
call. NAG runs its compiled write at both shapes (`kernel: inductor`), the path `auto` takes at
the given shape, so the tiny shape measures the same code. `--ops N` adds, per residual, the N
operators with the most CPU time of their own over one step (torch.profiler).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_residual_step import build, step


def cpu_seconds(model, optimizer, batch, args) -> float:
    start = time.process_time()
    step(model, optimizer, batch, args)
    return time.process_time() - start


def python_share(model, optimizer, batch, args) -> float:
    """Fraction of one profiled step spent in Python functions' own code (not in C functions)."""
    profile = cProfile.Profile()
    profile.enable()
    step(model, optimizer, batch, args)
    profile.disable()
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (calls, primitive, own, cumulative, callers)
    total = sum(own for _, _, own, _, _ in stats.values())
    in_python = sum(own for (file, _, _), (_, _, own, _, _) in stats.items() if file != "~")
    return in_python / total


def top_operators(model, optimizer, batch, args, count: int) -> str:
    """The `count` operators with the most CPU time of their own over one step, as a table."""
    with profile(activities=[ProfilerActivity.CPU]) as profiled:
        step(model, optimizer, batch, args)
    return profiled.key_averages().table(sort_by="self_cpu_time_total", row_limit=count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=32)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--residuals", nargs="+", default=["prenorm", "nag"])
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ops", type=int, default=0, help="print the N costliest operators per residual")
    args = parser.parse_args()
    shapes = {"given": (args.batch, args.seq_len), "tiny": (1, 8)}
    runs = {}
    for shape, (batch, seq_len) in shapes.items():
        shaped = argparse.Namespace(**{**vars(args), "batch": batch, "seq_len": seq_len, "device": "cpu",
                                       "precision": "32", "kernel": "inductor", "nag_options": "{}"})
        tokens = torch.randint(0, 256, (batch, seq_len + 1))
        for name in args.residuals:
            runs[name, shape] = (*build(name, shaped), tokens, shaped)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runs}
    for i in range(args.warmup + args.repeats):
        for key, run in runs.items():
            seconds = cpu_seconds(*run)
            if i >= args.warmup:
                times[key].append(seconds)
    sublayers = 2 * args.n_layers
    print(f"threads: {torch.get_num_threads()}, d={args.d_model}, layers={args.n_layers}, "
          f"seq={args.seq_len}, batch={args.batch}, repeats={args.repeats}, CPU time")
    print("| residual | step (ms) | tiny step (ms) | tiny / step | fixed cost per sublayer (us) | "
          "Python frames' share (profiled) |")
    print("|---|---|---|---|---|---|")
    for name in args.residuals:
        full, tiny = (statistics.median(times[name, shape]) for shape in shapes)
        share = python_share(*runs[name, "given"])
        print(f"| {name} | {1e3 * full:.0f} | {1e3 * tiny:.0f} | {tiny / full:.3f} | "
              f"{1e6 * tiny / sublayers:.0f} | {share:.3f} |")
    for name in args.residuals if args.ops else []:
        print(f"\n{name}:\n{top_operators(*runs[name, 'given'], args.ops)}")


if __name__ == "__main__":
    main()
