"""What a user waits for first: `nag-lightning fit` of a recipe, NAG against the same recipe with
`residual: prenorm`, from typing the command to the first training step and through the first
`--steps` steps (or the whole recipe, `--full`).

Each run is a new process. NAG runs twice with a cold inductor cache (a fresh
TORCHINDUCTOR_CACHE_DIR: what a first run on a machine pays) and twice with it warm (the same
folder again: every later run); pre-norm, which compiles nothing, twice. Runs alternate, so the
variants share the machine's load; medians. The times come from `step_clock.StepClock`, a callback
each run is given. No checkpoint and no log is written; validation is off unless `--full`.

    python benchmarks/bench_first_steps.py [--recipes recipes/quickstart.yaml ...] [--steps 100]
    python benchmarks/bench_first_steps.py --recipes recipes/quickstart.yaml --full
    python benchmarks/bench_first_steps.py --recipes recipes/tasks/hops.yaml --recipe-length

With `--recipe-length` each run keeps the recipe's own max_steps and is stopped after `--steps`: the
first steps of the run a user starts, which knows its length (a long run compiles NAG's CPU write,
`nag_kernels.compiled.MIN_RUN_ELEMENTS`, where a 100-step run would not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECIPES = ["recipes/quickstart.yaml", "recipes/bpe/quickstart.yaml", "recipes/tasks/hops.yaml"]
VARIANTS = ("prenorm", "nag, cold cache", "nag, warm cache")


def fit(recipe: str, variant: str, steps: int | None, cache: str, out: Path,
        recipe_length: bool = False) -> dict:
    """One `fit` in a new process; the StepClock's times (seconds from the command's start). With
    `recipe_length`, the run keeps the recipe's max_steps and stops after `steps`."""
    args = [sys.executable, "-m", "nag_lightning.cli", "fit", "--config", recipe,
            "--trainer.logger=false", "--checkpoint.save_last=false", "--checkpoint.save_top_k=0",
            f"--trainer.default_root_dir={out / 'root'}", "--trainer.enable_progress_bar=false",
            "--trainer.callbacks+=step_clock.StepClock"]
    if steps is not None:
        args += ["--trainer.limit_val_batches=0"]
        if not recipe_length:
            args += [f"--trainer.max_steps={steps}"]
    if variant == "prenorm":
        args += ["--model.arch.residual=prenorm"]
    clock = out / "clock.json"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, STEP_CLOCK_OUT=str(clock),
               STEP_CLOCK_START=repr(time.time()),
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    if recipe_length and steps is not None:
        env["STEP_CLOCK_STOP"] = str(steps)
    env.setdefault("OMP_NUM_THREADS", "1")
    done = subprocess.run(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0 or not clock.is_file():
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stdout[-3000:]}")
    return json.loads(clock.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    parser.add_argument("--steps", type=int, default=100, help="training steps per run")
    parser.add_argument("--full", action="store_true", help="the recipe's own steps and validation")
    parser.add_argument("--recipe-length", action="store_true",
                        help="keep the recipe's max_steps, stop after --steps (the start of a user's run)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write every run's times here")
    args = parser.parse_args()
    steps = None if args.full else args.steps
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for recipe in args.recipes:
            # untimed: data preparation (and a BPE tokenizer's training) happen once, before any timing
            fit(recipe, "prenorm", 1, str(Path(scratch) / "unused"), Path(scratch))
            cold_caches = [str(Path(scratch) / f"cold{i}-{Path(recipe).stem}") for i in range(args.repeats)]
            for repeat in range(args.repeats):
                for variant in VARIANTS:
                    cache = cold_caches[repeat] if variant != "nag, warm cache" else cold_caches[0]
                    clock = fit(recipe, variant, steps, cache, Path(scratch), args.recipe_length)
                    runs.setdefault((recipe, variant), []).append(clock)
                    print(recipe, variant, clock, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({f"{r} | {v}": c for (r, v), c in runs.items()}, indent=1))
    print(f"\nload average at the end: {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    span = "whole recipe" if args.full else f"{steps} steps"
    print(f"| recipe | run | command to first step (s) | first step (s) | command to end of {span} (s) |")
    print("|---|---|---|---|---|")
    for (recipe, variant), clocks in runs.items():
        med = {key: statistics.median(c[key] for c in clocks)
               for key in ("to_first_step", "first_step", "total")}
        print(f"| {recipe} | {variant} | {med['to_first_step']:.1f} | {med['first_step']:.2f} | "
              f"{med['total']:.1f} |")


if __name__ == "__main__":
    main()
