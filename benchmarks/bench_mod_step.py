"""CPU training-step time of Mixture-of-Depths routing against the unrouted model of the same size.

One training step = forward + backward + AdamW step, on random bytes. The configurations run
interleaved (dense, topk, threshold, dense, ...) so drifts of the machine's speed hit all alike;
each one's median is reported. The FLOP share saved comes from the analytic count of the executed
tokens (`nag_lightning.model.flops`, training = 3 x forward); the last column is how much of it shows up
as time saved.

    python3 benchmarks/bench_mod_step.py                 # d=256, 8 layers, seq 256, batch 8
    python3 benchmarks/bench_mod_step.py --repeats 3 --d-model 128 --layers 4   # quicker
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.model.flops import count_model


def build(args: argparse.Namespace, router: str, options: dict) -> tuple[Transformer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, seq_len=args.seq_len,
        residual=args.residual, router=router, router_options=options,
    )
    model = Transformer(cfg).train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model: Transformer, optimizer: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One training step; returns its wall time in seconds."""
    start = time.perf_counter()
    out = model(batch[:, :-1])
    loss = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten()) + out.aux_loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--residual", default="nag")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    configs = {
        "dense (router none)": ("none", {}),
        "topk, capacity 0.75": ("topk", {"capacity": 0.75}),
        "threshold, target 25%": ("threshold", {"target_rate": 0.25, "warmup_steps": 0}),
    }
    runs = {name: build(args, *spec) for name, spec in configs.items()}
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=g) for _ in range(4)]
    times: dict[str, list[float]] = {name: [] for name in runs}
    flops: dict[str, list[float]] = {name: [] for name in runs}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.warmup + args.repeats):
        for name, (model, optimizer) in runs.items():
            elapsed = step(model, optimizer, batches[i % len(batches)])
            if i >= args.warmup:
                count = count_model(model, args.seq_len)
                times[name].append(elapsed)
                flops[name].append(3 * count.forward)
                rates[name].append(count.mod_rate)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; d_model {args.d_model}, "
          f"{args.layers} layers, seq {args.seq_len}, batch {args.batch}, residual {args.residual}; "
          f"median of {args.repeats} steps")
    print()
    print("| configuration | MoD rate | training GFLOP/step | step time (s) | FLOPs saved | time saved "
          "| time saved / FLOPs saved |")
    print("|---|---|---|---|---|---|---|")
    dense = "dense (router none)"
    t0, f0 = statistics.median(times[dense]), statistics.median(flops[dense])
    for name in runs:
        t, f = statistics.median(times[name]), statistics.median(flops[name])
        saved_f, saved_t = 1 - f / f0, 1 - t / t0
        share = f"{saved_t / saved_f:.0%}" if name != dense else "-"
        print(f"| {name} | {statistics.mean(rates[name]):.1%} | {f / 1e9:.1f} | {t:.3f} | "
              f"{saved_f:.1%} | {saved_t:.1%} | {share} |")


if __name__ == "__main__":
    main()
