"""One GPU check: what the project has not measured on a GPU yet, in one run of under 8 minutes,
written to one JSON and one Markdown summary.

    python benchmarks/gpu_check.py --out gpu_check             # a machine with one CUDA GPU
    python benchmarks/gpu_check.py --dry-run --out /tmp/gc     # CPU, tiny sizes, seconds
    bash benchmarks/gpu_check.sh gpu_check                     # the first, with a log beside it

Sections, each independent (one that fails, errs or is skipped is recorded with its reason and
the others still run), each with a time budget that its loops and child processes respect:

    kernels                   the Triton NAG write against the PyTorch reference, forward and
                              backward, fp32 and bf16
    bandwidth                 the NAG write's achieved bandwidth over a device-to-device copy
                              measured in the same run (goal >= 90%)
    residual_step             NAG / prenorm training-step time and peak memory, d_model 1024,
                              12 blocks, bf16-mixed (goal: time ratio <= 1.02)
    mod_step                  the recommended routed setting (threshold on NAG's angle, MLPs
                              only, target 0.5: a 25% MoD rate), top-k and threshold at 25% on
                              every sublayer, against the unrouted model: time saved over the
                              FLOPs saved (`nag_lightning.model.flops`) (goal >= 0.8); and
                              milliseconds per token generated with the KV cache
    activation_checkpointing  NAG step time and peak memory with `activation_checkpointing`
    recipes                   two bf16-mixed steps of every recipes/scale recipe through the
                              command line, on this one device
    compile                   `torch.compile`d training step against eager, NAG and prenorm; NAG
                              with the write traced by inductor; MoD's FLOP saving kept when compiled

`--dry-run` runs the same code on CPU at tiny sizes (the kernels in Triton's interpreter), so the
test suite checks that every section runs and the summary has its shape; its numbers mean nothing.
The step benchmarks reuse `bench_residual_step.py` (model, step, peak memory) and
`bench_nag_write.py` (inputs, bytes moved, timing of one call, copy bandwidth).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TOTAL_BUDGET_S = 450.0  # all sections together; the process start and summary fit in 8 minutes

# Sizes of a real run and of the dry run.
SIZES = {
    "gpu": dict(d_model=1024, n_layers=12, n_heads=16, seq_len=1024, batch=8, repeats=10, warmup=3,
                kernel_shapes=[(4096, 1024), (1000, 4096), (37, 3000)], rows=16384, dims=[1024, 4096],
                copy_bytes=2**30),
    "dry": dict(d_model=64, n_layers=1, n_heads=2, seq_len=32, batch=2, repeats=2, warmup=1,
                kernel_shapes=[(6, 40)], rows=8, dims=[64], copy_bytes=2**20),
}
# The routed settings the MoD sections time, as (router, router options, sublayer kinds routed): the
# recommended one (docs/routing.md, "Which routing to use") and both routers on every sublayer.
ROUTED = {"mlp 50%": ("threshold", {"predictor": "angle", "target_rate": 0.5, "warmup_steps": 0}, ["mlp"]),
          "topk 25%": ("topk", {"capacity": 0.75}, ["attn", "mlp"]),
          "threshold 25%": ("threshold", {"target_rate": 0.25, "warmup_steps": 0}, ["attn", "mlp"])}
DECODED = 136  # tokens of the sequence the decode timing runs: a prompt of 8, then 128 generated
BUDGETS_S = {"kernels": 40, "bandwidth": 30, "residual_step": 30, "mod_step": 30,
             "activation_checkpointing": 25, "recipes": 150, "compile": 130}
# The recipes in the order they run; on one device multinode.yaml is fsdp.yaml, so it goes last.
RECIPES = ("gpu_bf16", "fsdp2", "ddp", "fsdp", "multinode")
# Largest difference over the largest magnitude, per output or gradient; both paths compute in fp32
# from the same rounded inputs, so fp32 differs by reduction order and bf16 by an output ulp or so.
KERNEL_TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2}
GOAL_COPY_SHARE, GOAL_TIME_RATIO, GOAL_SAVING_SHARE = 0.90, 1.02, 0.80


class Skip(Exception):
    """A section that cannot run here; the message says why."""


@dataclass
class Check:
    """What every section gets: the device, the sizes, the timer and its own deadline."""

    device: str
    dry_run: bool
    sizes: dict
    out: Path
    recipes: list[str] = field(default_factory=lambda: list(RECIPES))
    deadline: float = 0.0
    notes: list[str] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def bench(self, fn: Callable[[], Any], grad_to_none: list | None = None) -> float:
        """Milliseconds per call: triton's do_bench on CUDA, a median of a few calls elsewhere."""
        if self.device.startswith("cuda"):
            import triton.testing

            return triton.testing.do_bench(fn, grad_to_none=grad_to_none)
        times = []
        for _ in range(3):
            for t in grad_to_none or []:
                t.grad = None
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1000 * statistics.median(times)

    def step_args(self, precision: str = "bf16-mixed") -> argparse.Namespace:
        """Arguments in the shape `bench_residual_step.build/step` read."""
        s = self.sizes
        return argparse.Namespace(device=self.device, d_model=s["d_model"], n_layers=s["n_layers"],
                                  n_heads=s["n_heads"], seq_len=s["seq_len"], kernel="auto",
                                  nag_options="{}", precision=precision)


# ---- the training-step benchmarks share one timing loop -------------------------------------------


def time_steps(check: Check, runs: dict, after_step: Callable | None = None) -> dict[str, list[float]]:
    """Seconds per training step of every (model, optimizer) in `runs`, timed in alternation so
    drifts of the machine hit all alike; stops early (after at least one timed round) when the
    section's time runs out."""
    import bench_residual_step as brs
    import torch

    args = check.step_args()
    batch = torch.randint(0, 256, (check.sizes["batch"], check.sizes["seq_len"] + 1), device=check.device)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(check.sizes["warmup"] + check.sizes["repeats"]):
        if i > check.sizes["warmup"] and check.left() < 0:
            check.notes.append(f"timed {i - check.sizes['warmup']} rounds, not {check.sizes['repeats']}: "
                               "the section's time ran out")
            break
        for name, (model, optimizer) in runs.items():
            check.sync()
            start = time.perf_counter()
            brs.step(model, optimizer, batch, args)
            check.sync()
            if i >= check.sizes["warmup"]:
                times[name].append(time.perf_counter() - start)
                if after_step is not None:
                    after_step(name, model)
    return times


def peak_memory(check: Check, runs: dict) -> dict[str, int]:
    import bench_residual_step as brs
    import torch

    args = check.step_args()
    batch = torch.randint(0, 256, (check.sizes["batch"], check.sizes["seq_len"] + 1), device=check.device)
    peak = brs.gpu_peak_bytes if check.device.startswith("cuda") else brs.cpu_peak_bytes
    return {name: peak(model, optimizer, batch, args) for name, (model, optimizer) in runs.items()}


def ratios(times: dict[str, list[float]], memory: dict[str, int] | None, base: str) -> dict:
    t0 = statistics.median(times[base])
    out = {name: {"median_step_ms": 1000 * statistics.median(t), "steps_timed": len(t),
                  "time_ratio": statistics.median(t) / t0} for name, t in times.items()}
    for name in out if memory else ():
        out[name]["peak_memory_mib"] = memory[name] / 2**20
        out[name]["memory_ratio"] = memory[name] / memory[base]
    return out


def free_memory(check: Check) -> None:
    import gc

    import torch

    gc.collect()
    if check.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---- sections -------------------------------------------------------------------------------------


def kernels(check: Check) -> dict:
    """Forward and every gradient of the Triton NAG write against the PyTorch reference, with the
    angle from the bound (magnitude) and given (the gated NAG, the default)."""
    import torch

    import nag_kernels

    if nag_kernels._triton_ops is None:
        raise Skip("triton is not installed, so there is no kernel to check")
    from bench_nag_write import DTYPES, THETA_MAX, make_inputs

    results, worst = [], {}
    cases = [(dtype_name, rows, d, angle) for dtype_name in ("fp32", "bf16")
             for rows, d in check.sizes["kernel_shapes"] for angle in ("magnitude", "given")]
    for dtype_name, rows, d, angle in cases:
        x = make_inputs(rows, d, DTYPES[dtype_name], check.device, requires_grad=False)
        gen = torch.Generator(device=check.device).manual_seed(1)
        if angle == "given":
            x["angle"] = 0.5 * torch.rand(rows, device=check.device, generator=gen)
        cotangents = [torch.randn(x["u"].shape, device=check.device, generator=gen),
                      torch.randn(x["rho"].shape, device=check.device, generator=gen), None,
                      torch.randn(x["u"].shape, device=check.device, generator=gen)]
        runs = {}
        for backend in ("triton", "torch"):
            leaves = {k: v.detach().clone().requires_grad_(True) for k, v in x.items()}
            outs = nag_kernels.nag_write(**leaves, theta_max=THETA_MAX, backend=backend)
            loss = sum((o.float() * c).sum() for o, c in zip(outs, cotangents) if c is not None)
            loss.backward()
            names = ("u_new", "rho_new", "theta", "h_next")
            runs[backend] = {**dict(zip(names, outs)), **{f"grad_{k}": v.grad for k, v in leaves.items()}}
        errors = {}
        for name, want in runs["torch"].items():
            got = runs["triton"][name]
            if want is None or got is None:
                errors[name] = 0.0 if want is got else float("inf")
                continue
            scale = want.float().abs().max().clamp_min(1e-6)
            errors[name] = ((got.float() - want.float()).abs().max() / scale).item()
        results.append({"dtype": dtype_name, "rows": rows, "d": d, "angle": angle,
                        "max_relative_error": max(errors.values()), "errors": errors})
        worst[dtype_name] = max(worst.get(dtype_name, 0.0), max(errors.values()))
    met = all(worst[k] <= KERNEL_TOLERANCE[k] for k in worst)
    summary = ", ".join(f"{k}: worst {v:.1e} (tolerance {KERNEL_TOLERANCE[k]:.0e})" for k, v in worst.items())
    return {"results": results, "goal_met": met, "summary": summary}


def bandwidth(check: Check) -> dict:
    """GB/s the NAG write achieves (bytes it must move over its time) against a copy_."""
    import nag_kernels

    if nag_kernels._triton_ops is None:
        raise Skip("triton is not installed, so there is no kernel to time")
    from bench_nag_write import DTYPES, bytes_moved, copy_bandwidth_gbs, implementations, time_one

    copy_gbs = copy_bandwidth_gbs(check.device, check.sizes["copy_bytes"], bench=check.bench)
    triton_write = implementations()["triton"]
    results = []
    for dtype_name in ("bf16", "fp32"):
        for d in check.sizes["dims"]:
            for backward in (False, True):
                if check.left() < 0:
                    check.notes.append("stopped before every width and dtype: the section's time ran out")
                    break
                rows = check.sizes["rows"]
                ms = time_one(triton_write, rows, d, DTYPES[dtype_name], backward, check.device,
                              bench=check.bench)
                gbs = bytes_moved(rows, d, DTYPES[dtype_name], backward) / (ms * 1e-3) / 1e9
                results.append({"dtype": dtype_name, "d": d, "rows": rows,
                                "pass": "fwd+bwd" if backward else "fwd", "ms": ms, "GB/s": gbs,
                                "share_of_copy": gbs / copy_gbs})
    worst = min(r["share_of_copy"] for r in results)
    return {"results": {"copy_GB/s": copy_gbs, "calls": results}, "goal_met": worst >= GOAL_COPY_SHARE,
            "summary": f"copy {copy_gbs:.0f} GB/s; the write reaches {worst:.0%} to "
                       f"{max(r['share_of_copy'] for r in results):.0%} of it "
                       f"(goal >= {GOAL_COPY_SHARE:.0%})"}


def residual_step(check: Check) -> dict:
    """NAG against prenorm: training-step time and peak memory."""
    import bench_residual_step as brs

    args = check.step_args()
    runs = {name: brs.build(name, args) for name in ("prenorm", "nag")}
    table = ratios(time_steps(check, runs), peak_memory(check, runs), "prenorm")
    nag = table["nag"]
    return {"results": table, "goal_met": nag["time_ratio"] <= GOAL_TIME_RATIO,
            "summary": f"NAG / prenorm: time {nag['time_ratio']:.3f} (goal <= {GOAL_TIME_RATIO}), "
                       f"memory {nag['memory_ratio']:.3f}"}


def mod_step(check: Check) -> dict:
    """Routed at a 25% MoD rate against unrouted: how much of the FLOPs saved shows up as time saved."""
    import bench_residual_step as brs

    from nag_lightning.model.flops import count_model

    args = check.step_args()
    runs = {"unrouted": brs.build("nag", args)}
    for name, (router, options, kinds) in ROUTED.items():
        runs[name] = brs.build("nag", args, router=router, router_options=options, route_kinds=kinds)
    flops: dict[str, list[float]] = {name: [] for name in runs}
    rates: dict[str, list[float]] = {name: [] for name in runs}

    def count(name, model):
        counted = count_model(model, check.sizes["seq_len"])
        flops[name].append(3 * counted.forward)
        rates[name].append(counted.mod_rate)

    table = ratios(time_steps(check, runs, after_step=count), None, "unrouted")
    decode = decode_times(check, runs)
    f0 = statistics.median(flops["unrouted"])
    shares = {}
    for name, row in table.items():
        row["mod_rate"] = statistics.mean(rates[name])
        row["training_gflop_per_step"] = statistics.median(flops[name]) / 1e9
        saved_flops = 1 - statistics.median(flops[name]) / f0
        row["flops_saved"], row["time_saved"] = saved_flops, 1 - row["time_ratio"]
        if name != "unrouted":
            share = row["time_saved"] / saved_flops if saved_flops > 0 else float("nan")
            shares[name] = row["time_saved_over_flops_saved"] = share
    for name, row in table.items():
        row["decode"] = decode[name]
    decoded = ", ".join(f"{n} {d['ms_per_token']:.2f}" for n, d in decode.items())
    return {"results": table, "goal_met": all(v >= GOAL_SAVING_SHARE for v in shares.values()),
            "summary": "; ".join(f"{n}: {table[n]['flops_saved']:.0%} FLOPs saved, {s:.0%} of it as time"
                                 for n, s in shares.items()) + f" (goal >= {GOAL_SAVING_SHARE:.0%})"
                       + f"; ms per generated token (KV cache, batch 1): {decoded}"}


def decode_times(check: Check, runs: dict) -> dict[str, dict[str, float]]:
    """Milliseconds per generated token with the KV cache (batch 1, a prompt of 8 tokens, then one
    token a step to DECODED tokens or the model's sequence length) and the MoD rate of generation,
    per model, after `bench_mod_speed.calibrate` has set how often its router runs a token; the
    models train again afterwards."""
    import bench_mod_speed as bms
    import torch

    from nag_lightning.model.inference import CachedDecoder

    gen = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 256, (check.sizes["batch"], check.sizes["seq_len"] + 1), generator=gen)
    batch = batch.to(check.device)
    tokens, prompt = batch[0].tolist(), 8
    out = {}
    for name, (model, _) in runs.items():
        bms.calibrate(model, check.step_args(), batch)
        with torch.no_grad():
            decoder = CachedDecoder(model, 1)
            decoder.extend([tokens[:prompt]])
            check.sync()
            start = time.perf_counter()
            end = min(DECODED, check.sizes["seq_len"])  # the context may not outgrow the model
            ran = [bms.decode_token(decoder, token) for token in tokens[prompt:end]]
            check.sync()
        model.train()
        out[name] = {"ms_per_token": 1000 * (time.perf_counter() - start) / len(ran),
                     "mod_rate": 1 - sum(map(sum, ran)) / sum(map(len, ran))}
    return out


def activation_checkpointing(check: Check) -> dict:
    """NAG with and without activation checkpointing: what the recomputation costs and saves."""
    import bench_residual_step as brs

    args = check.step_args()
    runs = {"without": brs.build("nag", args), "with": brs.build("nag", args, activation_checkpointing=True)}
    table = ratios(time_steps(check, runs), peak_memory(check, runs), "without")
    row = table["with"]
    return {"results": table, "goal_met": None,
            "summary": f"with / without: time {row['time_ratio']:.3f}, memory {row['memory_ratio']:.3f}"}


def compile_model(model):
    """The compiled model the compile section times: the `model.compile` option's
    `nag_lightning.model.compile.compile_model` (inductor; in the dry run dynamo with the eager backend,
    so it takes seconds on CPU)."""
    from nag_lightning.model.compile import compile_model as compile_in_place

    return compile_in_place(model, backend="eager" if compile_model.dry_run else "inductor")


compile_model.dry_run = False


# What the compile section compiles, in order, while its time lasts: (residual, kernel, router,
# router options, sublayer kinds routed). "nag traced write" runs the write as plain operations that
# inductor generates its own Triton code for (`kernel: torch`), to weigh against the hand-written
# kernel's opaque op.
COMPILED = {"nag": ("nag", "auto", "none", {}, ["attn", "mlp"]),
            "prenorm": ("prenorm", "auto", "none", {}, ["attn", "mlp"]),
            "nag traced write": ("nag", "torch", "none", {}, ["attn", "mlp"]),
            **{name: ("nag", "auto", *routed) for name, routed in ROUTED.items()}}
SETTLED_STEP = 4  # dynamo must compile no graph after this many steps of each model
DRY_COMPILED = ("nag", "prenorm", "mlp 50%")  # the dry run's: unrouted, the baseline, one routed


def compile_section(check: Check) -> dict:
    """Compiled training steps: NAG and prenorm (each also eager), NAG with its write traced by
    the compiler, and the routed settings of ROUTED against compiled unrouted NAG (the share of
    the FLOP saving shown as time), while the section's time lasts; the first (compiling) step
    is timed on its own, and graphs compiled after step SETTLED_STEP are counted."""
    import bench_residual_step as brs
    import torch

    from nag_lightning.model.flops import count_model

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_model.dry_run = check.dry_run
    args = check.step_args()
    batch = torch.randint(0, 256, (check.sizes["batch"], check.sizes["seq_len"] + 1), device=check.device)
    runs, first_step_s = {}, {}
    for name, (residual, kernel, router, options, kinds) in COMPILED.items():
        if check.dry_run and name not in DRY_COMPILED:
            continue  # dynamo traces each model for seconds of CPU; these three check the section's code
        if runs and check.left() < 1.5 * first_step_s["nag compiled"]:
            check.notes.append(f"{name} not compiled: its compile would not fit in the section's time")
            break
        variant = argparse.Namespace(**{**vars(args), "kernel": kernel})
        model, optimizer = brs.build(residual, variant, router=router, router_options=options,
                                     route_kinds=kinds)
        runs[f"{name} compiled"] = (compile_model(model), optimizer)
        if name in ("nag", "prenorm"):
            runs[f"{name} eager"] = brs.build(name, args)
        for run in (f"{name} compiled", f"{name} eager"):
            if run in runs:
                check.sync()
                start = time.perf_counter()
                brs.step(*runs[run], batch, args)
                check.sync()
                first_step_s[run] = time.perf_counter() - start
    flops: dict[str, list[float]] = {name: [] for name in runs}
    graphs_after = {}  # step -> graphs compiled once every model had run that many steps

    def count(name, model):
        flops[name].append(3 * count_model(model, check.sizes["seq_len"]).forward)
        if name == next(reversed(runs)):
            steps = check.sizes["warmup"] + len(flops[name])
            graphs_after[steps] = torch._dynamo.utils.counters["stats"]["unique_graphs"]

    table = ratios(time_steps(check, runs, after_step=count), None, "nag eager")
    # the dry run times fewer steps than SETTLED_STEP: it counts after the last step it reached
    settled = max((n for n in graphs_after if n <= SETTLED_STEP), default=min(graphs_after))
    late = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_after.get(settled, 0)
    for name, row in table.items():
        row["first_step_s"] = first_step_s[name]
    shares = {}
    base = table["nag compiled"]
    for name in ROUTED:
        if f"{name} compiled" in table:
            row = table[f"{name} compiled"]
            saved_flops = 1 - statistics.median(flops[f"{name} compiled"]) / statistics.median(
                flops["nag compiled"])
            saved_time = 1 - row["median_step_ms"] / base["median_step_ms"]
            share = saved_time / saved_flops if saved_flops > 0 else float("nan")  # nothing skipped
            shares[name] = row["time_saved_over_flops_saved"] = share
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    ratio = {n: table[f"{n} compiled"]["median_step_ms"] / table[f"{n} eager"]["median_step_ms"]
             for n in ("nag", "prenorm") if f"{n} compiled" in table}
    over_prenorm = {n: table[f"{n} compiled"]["median_step_ms"] / table["prenorm compiled"]["median_step_ms"]
                    for n in ("nag", "nag traced write")
                    if "prenorm compiled" in table and f"{n} compiled" in table}
    summary = ("compiled / eager: " + ", ".join(f"{n} {r:.2f}" for n, r in ratio.items())
               + "".join(f"; {n} / prenorm compiled {r:.3f}" for n, r in over_prenorm.items())
               + "".join(f"; {n} compiled keeps {s:.0%} of its FLOP saving" for n, s in shares.items())
               + f"; {breaks} graph breaks, {late} graphs compiled after step {settled}")
    return {"results": {"steps": table, "graph_breaks": breaks, "graphs_compiled_after_step": {settled: late},
                        "graph_break_reasons": dict(torch._dynamo.utils.counters["graph_break"])},
            "goal_met": None, "summary": summary}


def recipes(check: Check) -> dict:
    """A few bf16-mixed steps of every scale recipe through `nag-lightning fit`, one device."""
    import yaml

    missing = [name for name in ("jsonargparse", "litdata") if importlib.util.find_spec(name) is None]
    if missing:
        raise Skip(f"{' and '.join(missing)} not installed: the recipes run through the command "
                   "line (LightningCLI needs jsonargparse) on litdata chunks")
    results = {}
    found = {p.stem for p in (ROOT / "recipes" / "scale").glob("*.yaml")}
    order = [*RECIPES, *sorted(found - set(RECIPES))]  # a recipe added later runs too
    paths = [ROOT / "recipes" / "scale" / f"{name}.yaml" for name in order
             if name in found and name in check.recipes]
    for recipe in paths:
        share = check.left()  # in priority order: a recipe may use what is left
        strategy = (yaml.safe_load(recipe.read_text())["trainer"].get("strategy") or {})
        strategy = strategy if isinstance(strategy, dict) else {"class_path": strategy}
        if share < 10:
            results[recipe.stem] = {"status": "skipped", "reason": "the section's time ran out"}
            continue
        if check.device == "cpu" and str(strategy.get("class_path", "")).endswith("FSDPStrategy"):
            results[recipe.stem] = {"status": "skipped",
                                    "reason": "Lightning's FSDPStrategy runs on GPUs only"}
            continue
        args = [sys.executable, "-m", "nag_lightning.cli", "fit", "--config", str(recipe),
                "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
                "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
                "--trainer.devices", "1", "--trainer.num_nodes", "1", "--trainer.logger", "false",
                "--trainer.enable_progress_bar", "false", "--checkpoint.save_last", "false",
                "--checkpoint.save_top_k", "0",  # a 24 x 1536 model's checkpoint is 11 GB
                "--trainer.default_root_dir", str(check.out / "recipes" / recipe.stem)]
        if "data_parallel_size" in (strategy.get("init_args") or {}):
            args += ["--trainer.strategy.init_args.data_parallel_size", "1"]
        if check.dry_run:
            args += ["--trainer.accelerator", "cpu", "--model.arch.d_model", "32",
                     "--model.arch.n_layers", "2", "--model.arch.n_heads", "2", "--model.arch.seq_len", "32",
                     "--data.batch_size", "2",
                     "--data.num_workers", "0", "--data.source", str(ROOT / "docs" / "*.md"),
                     "--data.cache_dir", str(check.out / "data_cache")]
        start = time.perf_counter()
        try:
            done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=share)
            status = "ok" if done.returncode == 0 else "failed"
            tail = "" if done.returncode == 0 else done.stderr.strip()[-1500:]
        except subprocess.TimeoutExpired:
            status, tail = "failed", f"did not finish within its {share:.0f} s"
        results[recipe.stem] = {"status": status, "seconds": round(time.perf_counter() - start, 1)}
        if tail:
            results[recipe.stem]["stderr_tail"] = tail
    ok = [name for name, r in results.items() if r["status"] == "ok"]
    others = [f"{name} {r['status']}" for name, r in results.items() if r["status"] != "ok"]
    return {"results": results, "goal_met": bool(ok) and len(ok) == len(paths),
            "summary": f"{len(ok)} of {len(paths)} recipes trained 2 steps"
                       + (f" ({', '.join(others)})" if others else "")}


# In the order they run: the quick ones first, compile (the longest) last.
SECTIONS: dict[str, Callable[[Check], dict]] = {
    "kernels": kernels, "bandwidth": bandwidth, "residual_step": residual_step, "mod_step": mod_step,
    "activation_checkpointing": activation_checkpointing, "recipes": recipes, "compile": compile_section,
}


# ---- running and writing ---------------------------------------------------------------------------


def run_section(name: str, check: Check, end: float) -> dict:
    """One section under its budget (and what is left of the whole), never raising."""
    budget = min(BUDGETS_S[name], end - time.monotonic())
    record: dict[str, Any] = {"status": "skipped", "budget_s": round(max(budget, 0), 1)}
    if budget < 5:
        record["reason"] = "the time of the whole check ran out before this section"
        return record
    check.deadline, check.notes = time.monotonic() + budget, []
    start = time.monotonic()
    try:
        record.update(SECTIONS[name](check), status="ok")
    except Skip as skip:
        record["reason"] = str(skip)
    except Exception as error:  # recorded; the next section runs regardless
        record.update(status="error", reason=f"{type(error).__name__}: {error}"[:1000],
                      traceback=traceback.format_exc()[-3000:])
    finally:
        free_memory(check)
    record["seconds"] = round(time.monotonic() - start, 1)
    if check.notes:
        record["notes"] = check.notes
    return record


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [f"# GPU check{' (dry run: CPU, tiny sizes, numbers meaningless)' if meta['dry_run'] else ''}",
             "", f"{meta['device']}; torch {meta['torch']}, triton {meta['triton']}; "
             f"{meta['seconds']:.0f} s in all. Command: `{meta['command']}`", "",
             "| section | status | goal met | result | seconds |", "|---|---|---|---|---|"]
    for name, s in report["sections"].items():
        met = {True: "yes", False: "**no**", None: "-"}[s.get("goal_met")]
        text = s.get("summary") or s.get("reason", "")
        lines.append(f"| {name} | {s['status']} | {met} | {text} | {s.get('seconds', 0):.0f} |")
    for name, s in report["sections"].items():
        lines += ["", f"## {name}", "", "```json", json.dumps(
            {k: v for k, v in s.items() if k not in ("summary", "traceback")}, indent=1, default=str), "```"]
        if "traceback" in s:
            lines += ["", "```", s["traceback"], "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: check the script itself")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES),
                        help="which recipes/scale recipes the recipes section runs (default: all)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device here; run it on a machine with one GPU, or with "
              "--dry-run to check the script on CPU.", file=sys.stderr)
        return 1
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the other benchmarks' helpers
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(device="cpu" if args.dry_run else "cuda", dry_run=args.dry_run,
                  sizes=SIZES["dry" if args.dry_run else "gpu"], out=args.out, recipes=args.recipes)
    triton_spec = importlib.util.find_spec("triton")
    started = time.monotonic()
    end = started + TOTAL_BUDGET_S
    report = {"meta": {
        "device": (torch.cuda.get_device_name() if check.device == "cuda"
                   else f"CPU ({platform.processor() or 'cpu'})"),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__ if triton_spec else "not installed",
        "dry_run": args.dry_run, "command": " ".join(["python", *sys.argv]),
        "sizes": check.sizes}, "sections": {}}
    for name in args.sections:
        print(f"gpu_check: {name} ...", file=sys.stderr, flush=True)
        report["sections"][name] = run_section(name, check, end)
        section = report["sections"][name]
        said = section.get("summary") or section.get("reason", "")
        print(f"gpu_check: {name}: {section['status']}: {said}", file=sys.stderr, flush=True)
    report["meta"]["seconds"] = time.monotonic() - started
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "gpu_check.md").write_text(markdown(report))
    print(f"gpu_check: wrote {args.out / 'gpu_check.json'} and {args.out / 'gpu_check.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
