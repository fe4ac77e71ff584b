"""NAG's CPU training step over prenorm, before and after a change to its write, side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_nag_overhead.py                  # against a530f32
    OMP_NUM_THREADS=1 python benchmarks/bench_nag_overhead.py --before REV --repeats 8

Three models of bench_residual_step.py's default shape (d=256, 8 blocks, 4 heads, seq 256, batch 8,
fp32): prenorm, NAG whose write, read and readout are those of git revision `--before` (its
`kernels/reference.py`, read with `git show`, autograd through `RecomputedReference`), and NAG as
checked out. Steps alternate between the three (ABC ABC ...), so a change in the machine's load
hits all of them; medians are reported, and the two NAG models must give the same losses. Run it
from the repository root (it reads the old revision from git).
"""

from __future__ import annotations

import argparse
import math
import statistics
import subprocess
import time
import types

import torch
import torch.nn.functional as F

from nag_lightning import Transformer, TransformerConfig


def old_reference(rev: str) -> types.ModuleType:
    """`kernels/reference.py` of revision `rev`, as a module (it imports only math and torch)."""
    source = subprocess.run(
        ["git", "show", f"{rev}:kernels/reference.py"], capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"reference_{rev}")
    exec(compile(source, f"{rev}:kernels/reference.py", "exec"), module.__dict__)
    if not hasattr(module, "RecomputedReference"):
        raise ValueError(f"{rev} has no RecomputedReference in kernels/reference.py; pick an older --before.")
    return module


def with_old_write(model: Transformer, old: types.ModuleType) -> Transformer:
    """The NAG strategy of `model` with the write, read and readout of the old revision."""
    s = model.strategy
    root_d = math.sqrt(s.d_model)

    def write(state, f, gate, index, need_angle=True):
        u, rho = state
        u_new, rho_new, theta, _ = old.RecomputedReference.apply(
            u, f, rho, gate, s.alpha[index], s.beta[index], s.bound.theta_max, None, "tanh"
        )
        return (u_new, rho_new), theta.detach().abs()

    def read(state, index):
        return root_d * state[0] * s.gamma[index]

    def final(state):
        u, rho = state
        return root_d * u * s.gamma_out, torch.exp(rho.clamp(-4.0, 4.0)).unsqueeze(-1)

    s.write, s.read, s.final = write, read, final
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="a530f32", help="git revision whose NAG write to compare")
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    old = old_reference(args.before)

    def build(residual: str):
        torch.manual_seed(0)
        cfg = TransformerConfig(d_model=256, n_layers=8, n_heads=4, seq_len=256, residual=residual)
        return Transformer(cfg)

    models = {"prenorm": build("prenorm"), f"nag at {args.before}": with_old_write(build("nag"), old),
              "nag": build("nag")}  # fmt: skip
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    batch = torch.randint(0, 256, (8, 257), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {name: [] for name in models}
    losses: dict[str, list[float]] = {name: [] for name in models}
    for i in range(args.warmup + args.repeats):
        for name, model in models.items():
            start = time.perf_counter()
            logits = model(batch[:, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            loss.backward()
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            losses[name].append(loss.item())
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)

    base = statistics.median(times["prenorm"])
    print(f"threads: {torch.get_num_threads()}, repeats: {args.repeats}")
    print("| model | median step (ms) | time / prenorm | last loss |")
    print("|---|---|---|---|")
    for name in models:
        median = statistics.median(times[name])
        print(f"| {name} | {1000 * median:.1f} | {median / base:.3f} | {losses[name][-1]:.6f} |")


if __name__ == "__main__":
    main()
