"""What every study shares: one training run per point, in its own process, cached.

A study (`nag-lightning study NAME`, each in `analysis/studies/<name>.py`) is a function whose typed
signature is its command line; it trains its points with `fit_run`, `nag-lightning fit` in a child
process (a crash costs one run, not the study) logging to `out/<name>/version_0`. A finished run,
one whose `result.json` exists, is not run again, so an interrupted study resumes where it
stopped; the cache is keyed by the run's name alone, so a study with other options belongs in
another `--out`. `run_one` is the point the depth and trade-off studies share: a recipe with one
residual strategy at one depth and seed (and, in a learning-rate sweep, learning rate).

A study's default recipe is one the package ships (`recipes/...`, found by `find_recipe`), so a
study runs from any working directory; any other recipe is given by its path.
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

DEFAULT_RESIDUALS = ("prenorm", "nag")  # the pair a study compares unless told; any registered one can join


def run_name(residual: str, depth: int, seed: int, lr: float | None = None) -> str:
    name = f"{residual}-L{depth}-s{seed}"
    return name if lr is None else f"{name}-lr{lr:g}"


def final_val_bpb(metrics_csv: Path) -> tuple[float, int]:
    """The last logged validation bits per byte and its step, from a CSVLogger file."""
    from nag_lightning.training.metrics import metric_number, metric_step, metrics_rows

    last = None
    for line, row in metrics_rows(metrics_csv):
        if row.get("val/bpb"):
            last = (metric_number(row["val/bpb"], metrics_csv, line, "val/bpb"),
                    metric_step(row.get("step"), metrics_csv, line))
    if last is None:
        raise ValueError(f"{metrics_csv} holds no val/bpb; did the run reach a validation?")
    return last


def fit_run(out: Path, name: str, args: list[str]) -> dict:
    """Train one run, `nag-lightning fit ARGS`, in a child process logging to `out/name/version_0`,
    and return its final validation bits per byte, step and wall time (cached in result.json: a
    finished run is not trained again)."""
    result_path = out / name / "result.json"
    if result_path.is_file():
        return json.loads(result_path.read_text())
    logger = {"class_path": "lightning.pytorch.loggers.CSVLogger",
              "init_args": {"save_dir": str(out), "name": name, "version": 0}}
    command = [sys.executable, "-m", "nag_lightning.cli", "fit", *args,
               f"--trainer.logger={json.dumps(logger)}"]
    start = time.time()
    log = out / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as handle:
        status = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT).returncode
    if status != 0:
        raise RuntimeError(f"The run {name} failed (exit {status}); its output is in {log}.")
    bpb, step = final_val_bpb(out / name / "version_0" / "metrics.csv")
    result = {"val_bpb": bpb, "step": step, "wall_s": round(time.time() - start, 1)}
    result_path.write_text(json.dumps(result))
    return result


def write_csv(rows: list[dict], path: Path) -> None:
    """`rows` as CSV, the columns in order of first appearance, a missing value empty."""
    fields = list(dict.fromkeys(key for row in rows for key in row))
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table of the cells in `rows` under `head`."""
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows]) + "\n"


def check_study_options(depths: list[int] | None = None, seeds: list[int] | None = None,
                        residuals: list[str] | None = None, **lists: list | None) -> None:
    """One sentence for a study option no run can be trained with, before any run: an empty list,
    a depth below one block, a seed the runs cannot take, a residual strategy that is neither
    registered nor a class path (its name also names the run's folder)."""
    from nag_lightning.analysis.checks import check_not_empty
    from nag_lightning.residuals import RESIDUALS

    check_not_empty(depths=depths, seeds=seeds, residuals=residuals, **lists)
    for residual in residuals or []:
        RESIDUALS.get(residual)  # an unknown name fails with the registered ones listed
    if depths is not None and any(depth < 1 for depth in depths):
        raise ValueError(f"Every depth in --depths is a number of blocks, at least 1; got {depths}.")
    if seeds is not None and any(not 0 <= seed < 2**32 for seed in seeds):
        raise ValueError(f"Every seed in --seeds must be from 0 to {2**32 - 1} (numpy's); got {seeds}.")


def shipped_recipes() -> Path:
    """The folder of the recipes the package ships: `nag_lightning/recipes` once installed (the
    wheel maps the checkout's `recipes/` there, see pyproject.toml), else the source checkout's
    `recipes/` beside the package (an editable install)."""
    installed = resources.files("nag_lightning") / "recipes"
    if installed.is_dir():
        return Path(str(installed))
    return Path(str(resources.files("nag_lightning"))).resolve().parent / "recipes"


def find_recipe(recipe: str) -> str:
    """The path of `recipe`: the file itself where it exists, else, for a path that starts with
    `recipes/` (every study's default), the package's own recipe of that name."""
    if Path(recipe).is_file():
        return recipe
    parts = Path(recipe).parts
    if parts[:1] == ("recipes",) and shipped_recipes().joinpath(*parts[1:]).is_file():
        return str(shipped_recipes().joinpath(*parts[1:]))
    raise FileNotFoundError(
        f"No recipe at {recipe} (relative paths start at {Path.cwd()}), nor among the package's own "
        "recipes; give the path of a fit YAML file."
    )


def angle_spread(diagnostics: Path) -> float | None:
    """Median over sublayers of q10/q90, the 10% over the 90% quantile of the per-token
    contribution angle, at the run's last validation: near 1 when every token turns by the same
    angle (nothing for a threshold router to tell apart), near 0 when the angle separates tokens.
    None without diagnostics."""
    if not diagnostics.is_file():
        return None
    entry = json.loads(diagnostics.read_text())[-1]
    ratios = [low / high for low, high in zip(entry["q0.1"], entry["q0.9"]) if high > 0]
    return statistics.median(ratios) if ratios else None


def held_out_bpb(ckpt: Path, batches: int, trust_checkpoint: bool = False) -> tuple[float, float]:
    """Bits per byte of a checkpoint on the first and on the second half of its first `batches`
    validation batches (the data it was trained on, read in order): one half picks, the other
    reports."""
    import torch

    from nag_lightning.analysis.evaluation.checkpoint import checkpoint_data, evaluate, first_batches
    from nag_lightning.checkpoints.loading import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded = load_model(ckpt, device, trust_checkpoint)
    data = checkpoint_data(loaded, use_saved_files=True)  # a run the study trained itself
    data.setup("validate")
    val = first_batches(data.val_dataloader(), batches)
    half = len(val) // 2
    if half == 0:
        raise ValueError(
            f"The validation split of {ckpt} holds {len(val)} batch; the selection and the "
            "report need one each: give more text or a smaller data.batch_size."
        )
    return tuple(evaluate(loaded.model, part, token_bytes=loaded.token_bytes)["bpb"]
                 for part in (val[:half], val[half:2 * half]))


def run_one(recipe: str, out: Path, residual: str, depth: int, seed: int, extra: list[str],
            lr: float | None = None, split_batches: int = 64, trust_checkpoint: bool = False) -> dict:
    """One point of the depth study (cached like every `fit_run`). A sweep run (`lr` given) also
    gets `select_bpb` and `report_bpb`, its bits per byte on the two halves of `split_batches`
    validation batches, cached in its result.json; `trust_checkpoint` lets that checkpoint name a
    plugin by class path (`nag_lightning.checkpoints.trust`)."""
    name = run_name(residual, depth, seed, lr)
    result_path = out / name / "result.json"
    if not result_path.is_file():
        recipe = find_recipe(recipe)  # a cached run needs no recipe
    args = ["--config", recipe, f"--model.arch.n_layers={depth}", f"--model.arch.residual={residual}",
            f"--seed_everything={seed}", *extra, *([f"--model.lr={lr}"] if lr is not None else [])]
    result = fit_run(out, name, args)
    if lr is not None and "report_bpb" not in result:
        ckpt = out / name / "version_0" / "checkpoints" / "last.ckpt"
        result["select_bpb"], result["report_bpb"] = held_out_bpb(ckpt, split_batches, trust_checkpoint)
        result_path.write_text(json.dumps(result))
    row = {"residual": residual, "depth": depth, "seed": seed, **({"lr": lr} if lr is not None else {}),
           **result}
    row["angle_q10_q90"] = angle_spread(out / name / "version_0" / "depth_diagnostics.json")
    return row
