"""Does Mixture-of-Depths' FLOP saving show up as time? The recommended routed setting and top-k at a
25% MoD rate against the unrouted model, training eager and compiled, at two sizes, and per token
generated with the KV cache.

    OMP_NUM_THREADS=1 python benchmarks/bench_mod_speed.py                    # every size and mode
    OMP_NUM_THREADS=1 python benchmarks/bench_mod_speed.py --sizes hops --modes eager --repeats 20

Configurations (NAG's default, as `recipes/tasks/hops_mod.yaml` trains it, for all three, so the
residual is the same and only the routing differs):

    unrouted     every token runs every sublayer
    mlp 50%      the recommended setting (docs/routing.md): the threshold router on NAG's planned
                 angle, MLP sublayers only, target_rate 0.5 (a 25% MoD rate)
    topk 0.75    top-k at capacity 0.75 on every sublayer (a 25% MoD rate)

Sizes: `large` (d_model 256, 8 blocks, 4 heads, sequence 256, batch 8) and `hops` (the hops
recipe's: d_model 64, 8 blocks, 4 heads, sequence 64, batch 32).

A training step is forward, backward and AdamW (`bench_residual_step.step`). Each (size, mode)
runs its three models alternated step by step in a process phase of their own, in an order
shuffled every round, `--warmup` untimed steps (compilation) then `--repeats` timed; medians.
"FLOPs saved" is the analytic count of what executed (`nag_lightning.model.flops.count_model`,
training = 3 x forward, routers included); the last column is the share of it saved as time.
Under compile it also counts the graphs dynamo compiled after step 4 (the goal is none).

`--profile STEPS` profiles each model's training steps instead and sums the operators' self time
by group (matrix products, routing's selects and scatters, the optimizer, the rest): where the
time goes, and what routing adds and removes.

`--decode` times generation with the KV cache instead: each model decodes the same tokens one
step at a time (prefill of 8 tokens, then one token per step, batch 1, eval mode), routed by what
the router does in generation (top-k: its causal predictor; threshold: its tau). The models are
untrained, so their MoD rate in generation is whatever the untrained router gives: it is printed.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

import torch
from bench_residual_step import build, step

from nag_lightning.model.compile import compile_model
from nag_lightning.model.flop_formula import head_flops_per_token
from nag_lightning.model.flops import count_model
from nag_lightning.model.inference import CachedDecoder
from nag_lightning.model.kv_cache import CachedPass
from nag_lightning.model.sublayer import SUBLAYER_MODULES
from nag_lightning.routers.topk import TopKRouter

SIZES = {
    "large": dict(d_model=256, n_layers=8, n_heads=4, seq_len=256, batch=8),
    "hops": dict(d_model=64, n_layers=8, n_heads=4, seq_len=64, batch=32),
}
CONFIGS = {
    "unrouted": dict(router="none"),
    "mlp 50%": dict(router="threshold", route_kinds=["mlp"],
                    router_options={"predictor": "angle", "target_rate": 0.5, "warmup_steps": 0}),
    "topk 0.75": dict(router="topk", router_options={"capacity": 0.75}),
}
SETTLED_STEP = 4  # no graph may be compiled after this many steps of each model


def settings(size: str, kernel: str) -> argparse.Namespace:
    """Arguments in the shape `bench_residual_step.build/step` read."""
    s = SIZES[size]
    return argparse.Namespace(device="cpu", kernel=kernel, nag_options="{}", precision="32",
                              **{k: v for k, v in s.items() if k != "batch"})


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (first compilations and recompilations)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def build_runs(size: str, mode: str, kernel: str) -> dict:
    runs = {}
    for name, config in CONFIGS.items():
        model, optimizer = build("nag", settings(size, kernel), **config)
        runs[name] = (compile_model(model) if mode == "compiled" else model, optimizer)
    return runs


def train_phase(size: str, mode: str, args: argparse.Namespace) -> dict:
    """Step times, training FLOPs and MoD rates of the three models, and the late graphs."""
    s, cfg = SIZES[size], settings(size, args.kernel)
    runs = build_runs(size, mode, args.kernel)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (s["batch"], s["seq_len"] + 1), generator=gen) for _ in range(4)]
    times = {name: [] for name in runs}
    flops = {name: [] for name in runs}
    rates = {name: [] for name in runs}
    order, names, settled = random.Random(0), list(runs), graphs_compiled()
    for i in range(args.warmup + args.repeats):
        order.shuffle(names)
        for name in names:
            model, optimizer = runs[name]
            start = time.perf_counter()
            step(model, optimizer, batches[i % len(batches)], cfg)
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                times[name].append(elapsed)
                counted = count_model(model, s["seq_len"])
                flops[name].append(3 * counted.forward)
                rates[name].append(counted.mod_rate)
        if i == SETTLED_STEP - 1:
            settled = graphs_compiled()
    late = graphs_compiled() - settled
    del runs
    gc.collect()
    return dict(times=times, flops=flops, rates=rates, late=late)


# Operator groups of `--profile`, by the aten names of a CPU step's operators.
GROUPS = {
    "matrix products": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward"),
    "routing: select, gather, scatter, sort": (
        "aten::index_select", "aten::index_copy", "aten::index_copy_", "aten::index_add", "aten::index_add_",
        "aten::nonzero", "aten::gather", "aten::scatter", "aten::scatter_", "aten::scatter_add_",
        "aten::index", "aten::index_put_", "aten::_index_put_impl_", "aten::sort", "aten::topk", "aten::quantile",
        "aten::kthvalue", "aten::cumsum", "aten::argsort", "aten::masked_select"),
}


def group_of(op: str) -> str:
    for group, ops in GROUPS.items():
        if op in ops:
            return group
    if op.startswith("Optimizer.") or "adamw" in op or "foreach" in op:
        return "optimizer"
    return "everything else (elementwise, norms, NAG's write, autograd)"


def profile_phase(size: str, mode: str, args: argparse.Namespace) -> None:
    """Where a step's time goes: self CPU time per operator group, per model, the mean of `--profile`
    steps after the warm-up, the models alternated step by step (torch.profiler's own overhead
    included, alike for every model)."""
    from torch.profiler import ProfilerActivity, profile

    s, cfg = SIZES[size], settings(size, args.kernel)
    runs = build_runs(size, mode, args.kernel)
    batch = torch.randint(0, 256, (s["batch"], s["seq_len"] + 1), generator=torch.Generator().manual_seed(0))
    for model, optimizer in runs.values():
        for _ in range(args.warmup):
            step(model, optimizer, batch, cfg)
    per_step: dict[str, dict[str, float]] = {name: {} for name in runs}
    order, names = random.Random(0), list(runs)
    for _ in range(args.profile):  # one step of each model in turn: the machine's load hits them alike
        order.shuffle(names)
        for name in names:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(*runs[name], batch, cfg)
            groups = per_step[name]
            for event in prof.key_averages():
                key = group_of(event.key)
                groups[key] = groups.get(key, 0.0) + event.self_cpu_time_total / 1000 / args.profile
    print(f"\n{size}, {mode}: self CPU ms per training step by operator group (torch.profiler, "
          f"{args.profile} steps after {args.warmup})\n")
    names = list(runs)
    print("| operator group | " + " | ".join(names) + " | "
          + " | ".join(f"{n} - unrouted" for n in names[1:]) + " |")
    print("|---|" + "---|" * (2 * len(names) - 1))
    keys = sorted({k for g in per_step.values() for k in g}) + ["total"]
    for g in per_step.values():
        g["total"] = sum(g.values())
    for key in keys:
        cells = [per_step[n].get(key, 0.0) for n in names]
        print(f"| {key} | " + " | ".join(f"{c:.1f}" for c in cells) + " | "
              + " | ".join(f"{c - cells[0]:+.1f}" for c in cells[1:]) + " |")


def print_training(size: str, mode: str, result: dict, args: argparse.Namespace) -> None:
    s = SIZES[size]
    late = f"; graphs compiled after step {SETTLED_STEP}: {result['late']}" if mode == "compiled" else ""
    print(f"\n{size} (d_model {s['d_model']}, {s['n_layers']} blocks, sequence {s['seq_len']}, batch "
          f"{s['batch']}), {mode}: median of {args.repeats} steps after {args.warmup}{late}\n")
    print("| configuration | MoD rate | training GFLOP/step | step (ms) | FLOPs saved | time saved "
          "| time saved / FLOPs saved |")
    print("|---|---|---|---|---|---|---|")
    times, flops = result["times"], result["flops"]
    t0, f0 = statistics.median(times["unrouted"]), statistics.median(flops["unrouted"])
    for name in CONFIGS:
        t, f = statistics.median(times[name]), statistics.median(flops[name])
        saved_t, saved_f = 1 - t / t0, 1 - f / f0
        share = f"**{saved_t / saved_f:.0%}**" if saved_f > 0 else "-"
        print(f"| {name} | {statistics.mean(result['rates'][name]):.1%} | {f / 1e9:.2f} | {1000 * t:.1f} "
              f"| {saved_f:.1%} | {saved_t:.1%} | {share} |")


def calibrate(model, cfg: argparse.Namespace, batch: torch.Tensor) -> None:
    """Route in generation as a trained model would: a few training steps set the threshold
    router's tau at its target share of a batch; top-k's causal predictor, untrained, gets its
    output bias moved so it runs the capacity share of a batch's tokens (a token runs where its
    logit is above 0)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for _ in range(3):
        step(model, optimizer, batch, cfg)
    model.eval()
    logits: dict = {}
    hooks = [sub.router.predictor.register_forward_hook(lambda m, i, out, r=sub.router: logits.update({r: out}))
             for sub in model.sublayers if isinstance(sub.router, TopKRouter)]
    with torch.no_grad():
        model(batch[:, :-1])
        for router, out in logits.items():
            router.predictor[-1].bias -= out.flatten().quantile(1 - router.capacity)
    for hook in hooks:
        hook.remove()


def decode_token(decoder: CachedDecoder, token: int) -> list:
    """One generation step of one token (batch 1), as `CachedDecoder.extend` runs it; returns,
    per sublayer, whether the token ran it."""
    model = decoder.model
    idx = torch.tensor([[token]], device=decoder.device)
    cached = CachedPass(decoder.caches, torch.tensor([[decoder.length[0]]], device=decoder.device))
    model.readout(tuple(lane[:, -1] for lane in model.stream(idx, cached)))
    decoder.length[0] += 1
    return [executed is None or bool(executed.any()) for executed in cached.executed]


def decode_flops(model, ran: list[list[bool]], cached_before: dict[int, int]) -> float:
    """Mean forward FLOPs of a generated token, over the steps `ran` (per step, per sublayer,
    whether the token ran it): the sublayers it ran (projections and MLP, and for attention its
    scores and values over that sublayer's cache entries, `cached_before` holding them before the
    first step), the routers' evaluation-mode scoring, and the head."""
    cfg, cached = model.cfg, dict(cached_before)
    total = 0.0
    for step_ran in ran:
        total += head_flops_per_token(cfg)
        for sub, executed in zip(model.sublayers, step_ran):
            total += sub.router.flops_per_token()
            if executed:
                total += 2 * SUBLAYER_MODULES[sub.kind].weights(cfg)
                if sub.kind == "attn":
                    cached[sub.index] += 1
                    total += SUBLAYER_MODULES["attn"].pair_flops(cfg) * cached[sub.index]
    return total / len(ran)


def decode_phase(size: str, args: argparse.Namespace) -> None:
    """Milliseconds per generated token with the KV cache, batch 1, the three models alternated."""
    s, cfg = SIZES[size], settings(size, args.kernel)
    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 256, (s["batch"], s["seq_len"] + 1), generator=gen)
    tokens = torch.randint(0, 256, (s["seq_len"],), generator=gen).tolist()
    prompt, steps = 8, s["seq_len"] - 8
    models = {}
    for name, config in CONFIGS.items():
        models[name] = build("nag", cfg, **config)[0]
        calibrate(models[name], cfg, batch)
    per_token = {name: [] for name in models}
    flops = {name: [] for name in models}
    skipped = {name: [] for name in models}
    order, names = random.Random(0), list(models)
    with torch.no_grad():
        for i in range(1 + args.repeats):
            order.shuffle(names)
            for name in names:
                decoder = CachedDecoder(models[name], 1)
                decoder.extend([tokens[:prompt]])
                before = {index: int(cache.length[0]) for index, cache in decoder.caches.items()}
                ran = []
                start = time.perf_counter()
                for t in range(prompt, prompt + steps):
                    ran.append(decode_token(decoder, tokens[t]))
                elapsed = time.perf_counter() - start
                if i > 0:  # the first round warms up
                    per_token[name].append(elapsed / steps)
                    skipped[name].append(1 - sum(map(sum, ran)) / sum(map(len, ran)))
                    flops[name].append(decode_flops(models[name], ran, before))
    print(f"\n{size}, generation with the KV cache, batch 1: a prompt of {prompt} tokens, then {steps} "
          f"steps of one token; median of {args.repeats} runs\n")
    print("| configuration | MoD rate | forward MFLOP/token | ms per token | FLOPs saved | time saved "
          "| time saved / FLOPs saved |")
    print("|---|---|---|---|---|---|---|")
    t0, f0 = statistics.median(per_token["unrouted"]), statistics.median(flops["unrouted"])
    for name in CONFIGS:
        t, f = statistics.median(per_token[name]), statistics.median(flops[name])
        saved_t, saved_f = 1 - t / t0, 1 - f / f0
        share = f"**{saved_t / saved_f:.0%}**" if saved_f > 0 else "-"
        print(f"| {name} | {statistics.mean(skipped[name]):.1%} | {f / 1e6:.2f} | {1000 * t:.3f} | {saved_f:.1%} "
              f"| {saved_t:.1%} | {share} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=list(SIZES))
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    parser.add_argument("--repeats", type=int, default=10, help="timed steps of each model")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps of each model (compiles)")
    parser.add_argument("--kernel", choices=("auto", "torch"), default="auto",
                        help="NAG's CPU write: auto (inductor-compiled) or torch (the PyTorch reference)")
    parser.add_argument("--decode", action="store_true", help="time cached generation instead of training")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="profile STEPS training steps of each model by operator group, instead of timing")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread, NAG write kernel {args.kernel}")
    for size in args.sizes:
        if args.decode:
            decode_phase(size, args)
            continue
        for mode in args.modes:
            if args.profile:
                profile_phase(size, mode, args)
                continue
            print_training(size, mode, train_phase(size, mode, args), args)


if __name__ == "__main__":
    main()
