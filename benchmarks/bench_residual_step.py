"""Training-step time and peak memory of every residual strategy over pre-norm, side by side in one process.

    python benchmarks/bench_residual_step.py                       # CPU: d=256, 8 layers, seq 256
    python benchmarks/bench_residual_step.py --residuals nag ngpt  # a subset (prenorm always runs)
    python benchmarks/bench_residual_step.py --residuals nag --nag-kernels torch inductor  # write backends
    python benchmarks/bench_residual_step.py --device cuda --d-model 2048 --n-layers 24 \
        --seq-len 2048 --batch 8 --precision bf16-mixed           # a GPU-sized model

Each step is forward, backward, an AdamW update and the strategy's weight projection (nGPT's
renormalization of every matrix; nothing for the others), as in training. The models are timed in
alternation (ABC...ABC...), so drifts in machine load hit all of them, and the median is reported.
Peak memory is `torch.cuda.max_memory_allocated` on a GPU; on CPU it is the bytes held by
parameters, gradients, optimizer state and the tensors autograd saves for backward (deduplicated by
storage), at the end of the forward pass, which is where a training step peaks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch
import torch.nn.functional as F

from nag_kernels.compiled import wait_until_compiled
from nag_lightning import Transformer, TransformerConfig
from nag_lightning.residuals import RESIDUALS
from nag_lightning.training.optim import fused_adamw


def build(residual: str, args: argparse.Namespace, **config) -> tuple[Transformer, torch.optim.Optimizer]:
    """The model (`config`: further TransformerConfig fields, e.g. a router) and its AdamW."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads, seq_len=args.seq_len,
        residual=residual, vocab_size=getattr(args, "vocab", 256),
        residual_options={"kernel": args.kernel, **json.loads(args.nag_options)} if residual == "nag" else {},
        **config,
    )
    model = Transformer(cfg).to(args.device)
    model.strategy.project_weights(model)
    params = list(model.parameters())
    return model, torch.optim.AdamW(params, lr=1e-4, fused=fused_adamw(params))  # as training's


def autocast(args: argparse.Namespace):
    if args.precision == "bf16-mixed":
        return torch.autocast(device_type=torch.device(args.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def step(model: Transformer, optimizer: torch.optim.Optimizer, batch: torch.Tensor, args) -> None:
    with autocast(args):
        out = model(batch[:, :-1])  # a router's auxiliary loss trains it, as in training
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch[:, 1:].flatten()) + out.aux_loss
    loss.backward()
    optimizer.step()
    model.strategy.project_weights(model)
    optimizer.zero_grad(set_to_none=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cpu_peak_bytes(model, optimizer, batch, args) -> int:
    """Parameters + gradients + AdamW state + tensors saved for backward, at the end of forward."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(args):
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    del loss, logits
    # AdamW keeps two moments per parameter; gradients match the parameters.
    return sum(saved.values()) + params * 4


def gpu_peak_bytes(model, optimizer, batch, args) -> int:
    step(model, optimizer, batch, args)  # optimizer state exists from here on
    sync(args.device)
    torch.cuda.reset_peak_memory_stats()
    step(model, optimizer, batch, args)
    sync(args.device)
    return torch.cuda.max_memory_allocated()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (256: bytes)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--precision", choices=("32", "bf16-mixed"), default="32")
    kernels = ("auto", "triton", "inductor", "torch")
    parser.add_argument("--kernel", choices=kernels, default="auto")
    parser.add_argument("--nag-kernels", nargs="+", default=None, choices=kernels,
                        help="time NAG once per write backend, side by side (e.g. torch inductor)")
    parser.add_argument("--nag-options", default="{}",
                        help='further NAG options as JSON, e.g. \'{"norm_lane_readout": false}\'')
    parser.add_argument("--residuals", nargs="+", default=None,
                        help="strategies to measure against prenorm (default: every registered one)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    batch = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), device=args.device)
    names = ["prenorm", *(n for n in (args.residuals or RESIDUALS.names()) if n != "prenorm")]
    for name in names:
        RESIDUALS.get(name)  # an unknown name fails here with the registered ones listed
    models = {}
    for name in names:
        for kernel in (args.nag_kernels or [args.kernel]) if name == "nag" else [args.kernel]:
            label = f"nag ({kernel})" if name == "nag" and args.nag_kernels else name
            models[label] = build(name, argparse.Namespace(**{**vars(args), "kernel": kernel}))
    times: dict[str, list[float]] = {name: [] for name in models}
    for i in range(args.warmup + args.repeats):
        for name, (model, optimizer) in models.items():
            sync(args.device)
            start = time.perf_counter()
            step(model, optimizer, batch, args)
            sync(args.device)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - start)
        if i == args.warmup - 1:  # time NAG's compiled CPU write, not the reference it runs meanwhile
            wait_until_compiled()

    peak = gpu_peak_bytes if args.device.startswith("cuda") else cpu_peak_bytes
    memory = {name: peak(model, optimizer, batch, args) for name, (model, optimizer) in models.items()}
    params = {name: sum(p.numel() for p in m.parameters()) for name, (m, _) in models.items()}
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"device: {device}, threads: {torch.get_num_threads()}, d={args.d_model}, "
          f"layers={args.n_layers}, seq={args.seq_len}, batch={args.batch}, vocab={args.vocab}, "
          f"precision={args.precision}, kernel={args.kernel}, repeats={args.repeats}")
    base_time, base_memory = statistics.median(times["prenorm"]), memory["prenorm"]
    print("| residual | params | median step (ms) | peak memory (MiB) | time / prenorm | "
          "memory / prenorm | params / prenorm |")
    print("|---|---|---|---|---|---|---|")
    for name in models:
        median = statistics.median(times[name])
        print(f"| {name} | {params[name]:,} | {1000 * median:.1f} | {memory[name] / 2**20:.1f} | "
              f"{median / base_time:.3f} | {memory[name] / base_memory:.3f} | "
              f"{params[name] / params['prenorm']:.5f} |")


if __name__ == "__main__":
    main()
