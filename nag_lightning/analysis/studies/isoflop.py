"""`nag-lightning study isoflop`: the iso-FLOP recipes over several seeds, one command.

Every recipe of `recipes/isoflop/` spends the same training-FLOP budget with the same layer
parameters; a routed model, cheaper per token, sees more tokens. Each (recipe, seed) is one
`nag-lightning fit` in its own process and folder under `--out` (cached: an interrupted study
resumes). At the end the study writes:

    isoflop.csv       one row per run: tokens seen, training FLOPs, training seconds, executed
                      fraction, final val bpb
    isoflop.md        one row per recipe: the mean over seeds, with the seeds' min-max
    isoflop.png       val bpb against training FLOPs (every run), and final val bpb per recipe
    isoflop_time.png  its wall-clock twin: val bpb against training seconds (validation left out),
                      and final val bpb against each run's training seconds, so a routed recipe
                      that reaches the full-depth bpb sooner shows it. The runs of a study run one
                      after another, so only a machine whose load stays the same makes them comparable.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

from nag_lightning.analysis.reports.compare import COLUMNS, format_cell, summarize
from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.analysis.studies.study import check_study_options, find_recipe, fit_run

DEFAULT_RECIPES = [
    "prenorm", "nag", "nag_threshold20", "nag_threshold25", "nag_threshold_angle20", "nag_threshold_angle25",
    "nag_threshold_angle_mlp50", "nag_topk20", "nag_topk25",
]


def run_recipe(recipe: Path, out: Path, seed: int, extra: list[str]) -> dict:
    """Train one (recipe, seed) and return its comparison row plus the recipe and seed."""
    name = f"{recipe.stem}-s{seed}"
    fit_run(out, name, ["--config", str(recipe), f"--seed_everything={seed}", *extra])
    summary = summarize(out / name / "version_0", name)
    if not summary.has_flops:
        raise ValueError(
            f"The run of {recipe} logged no training FLOPs; add nag_lightning.callbacks.FlopAccounting "
            "and FlopBudget to its trainer.callbacks."
        )
    return {"recipe": recipe.stem, "seed": seed, **summary.row(), "curve": summary.curve,
            "time_curve": summary.time_curve}


def aggregate(results: list[dict]) -> list[dict]:
    """Per recipe, in the order first seen: mean and min-max over seeds of the final val bpb."""
    rows = []
    for recipe in dict.fromkeys(r["recipe"] for r in results):
        runs = [r for r in results if r["recipe"] == recipe]
        bpb = [r["final_val_bpb"] for r in runs]
        rows.append({
            "recipe": recipe, "residual": runs[0]["residual"], "router": runs[0]["router"],
            "seeds": len(runs), "tokens": statistics.fmean(r["tokens"] for r in runs),
            "training_flops": statistics.fmean(r["training_flops"] for r in runs),
            "train_seconds": statistics.fmean(r["train_seconds"] for r in runs),  # nan if one lacks them
            "executed_fraction": statistics.fmean(r["executed_fraction"] for r in runs),
            "bpb_mean": statistics.fmean(bpb), "bpb_min": min(bpb), "bpb_max": max(bpb),
        })
    return rows


def write_tables(results: list[dict], rows: list[dict], out: Path) -> None:
    lines = ["| recipe | residual | router | seeds | tokens seen (mean) | training FLOPs "
             "| training seconds (mean) | executed fraction | final val bpb, mean (min-max) |",
             "|" + "---|" * 9]
    for r in rows:
        seconds = "-" if math.isnan(r["train_seconds"]) else f"{r['train_seconds']:,.1f}"
        lines.append(
            f"| {r['recipe']} | {r['residual']} | {r['router']} | {r['seeds']} | {r['tokens']:,.0f} "
            f"| {r['training_flops']:.4g} | {seconds} | {r['executed_fraction']:.3f} "
            f"| {r['bpb_mean']:.4f} ({r['bpb_min']:.4f}-{r['bpb_max']:.4f}) |"
        )
    (out / "isoflop.md").write_text("\n".join(lines) + "\n")
    # a run without seconds (logged before they were kept) is an empty cell, as compare writes it
    with (out / "isoflop.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["recipe", "seed", *COLUMNS])
        writer.writeheader()
        writer.writerows({k: format_cell(r[k], "") for k in writer.fieldnames} for r in results)


def plot_curves(ax, results: list[dict], rows: list[dict], key: str) -> None:
    """Val bpb of every run against `key`'s x values ("curve": FLOPs, "time_curve": seconds), one
    colour per recipe, labelled once."""
    colors = {r["recipe"]: f"C{i}" for i, r in enumerate(rows)}
    for r in results:
        if r[key]:
            x, y = zip(*r[key])
            first = r is next(q for q in results if q["recipe"] == r["recipe"] and q[key])
            ax.plot(x, y, color=colors[r["recipe"]], lw=1, alpha=0.8, label=r["recipe"] if first else None)
    lows = [r["bpb_min"] for r in rows]
    ax.set_ylim(min(lows) - 0.1, min(lows) + 1.2)  # the early, steep part hides the end
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def plot(results: list[dict], rows: list[dict], path: Path) -> Path:
    plt = pyplot()
    fig, (ax_curve, ax_final) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = {r["recipe"]: f"C{i}" for i, r in enumerate(rows)}
    plot_curves(ax_curve, results, rows, "curve")
    ax_curve.set(xlabel="training FLOPs", ylabel="validation bits per byte",
                 title="Same parameters and training FLOPs (one line per seed)")
    for i, row in enumerate(rows):
        finals = [r["final_val_bpb"] for r in results if r["recipe"] == row["recipe"]]
        ax_final.plot([i] * len(finals), finals, "o", color=colors[row["recipe"]], alpha=0.6)
        ax_final.plot([i - 0.25, i + 0.25], [row["bpb_mean"]] * 2, color="black")
        ax_final.annotate(f"{row['tokens'] / 1e3:,.0f}k tokens", (i, row["bpb_max"]), fontsize=7,
                          ha="center", xytext=(0, 6), textcoords="offset points")
    ax_final.set_xticks(range(len(rows)), [r["recipe"] for r in rows], rotation=20, fontsize=8)
    ax_final.set(ylabel="final validation bits per byte",
                 title="Final val bpb per recipe (dots: seeds, bar: mean)")
    ax_final.grid(alpha=0.3, axis="y")
    ax_final.margins(y=0.15)  # room for the token labels above the highest seed
    return save(fig, path)


def plot_time(results: list[dict], rows: list[dict], path: Path) -> Path:
    """The wall-clock twin of `plot`: val bpb against training seconds (every run), and each run's
    final val bpb at the seconds it trained, so a recipe that reaches a bpb sooner sits left."""
    plt = pyplot()
    fig, (ax_curve, ax_final) = plt.subplots(1, 2, figsize=(12, 4.5))
    plot_curves(ax_curve, results, rows, "time_curve")
    ax_curve.set(xlabel="training wall-clock seconds (validation left out)", ylabel="validation bits per byte",
                 title="The same runs against training time (one line per seed)")
    for i, row in enumerate(rows):
        runs = [r for r in results if r["recipe"] == row["recipe"] and not math.isnan(r["train_seconds"])]
        ax_final.plot([r["train_seconds"] for r in runs], [r["final_val_bpb"] for r in runs], "o",
                      color=f"C{i}", alpha=0.7, label=row["recipe"] if runs else None)
    ax_final.set(xlabel="training wall-clock seconds", ylabel="final validation bits per byte",
                 title="Final val bpb at each run's training time (dots: seeds)")
    ax_final.grid(alpha=0.3)
    if ax_final.get_legend_handles_labels()[0]:
        ax_final.legend(fontsize=8)
    return save(fig, path)


def isoflop_study(
    recipes: list[str] = [f"recipes/isoflop/{name}.yaml" for name in DEFAULT_RECIPES],  # noqa: B006
    out: str = "runs/study/isoflop",
    seeds: list[int] = [1, 2, 3],  # noqa: B006 - jsonargparse reads the default as data
    extra: list[str] = [],  # noqa: B006
) -> list[dict]:
    """Run every iso-FLOP recipe with every seed, then write tables and figures.

    Args:
        recipes: fit recipes that share a training-FLOP budget (each needs FlopAccounting and
            FlopBudget among its callbacks); a path under recipes/ that is not a file here names
            the package's own recipe.
        out: folder for the runs, tables and figures.
        seeds: seeds per recipe; at least 2 before drawing a conclusion.
        extra: further `fit` arguments passed to every run, e.g. ["--trainer.max_steps=100"].
    """
    check_study_options(seeds=seeds, recipes=recipes)
    paths = [Path(find_recipe(r)) for r in recipes]
    out_dir = Path(out)
    results = []
    for seed in seeds:  # seed-major: a partial study already has one seed of every recipe
        for recipe in paths:
            result = run_recipe(recipe, out_dir, seed, extra)
            print(json.dumps({k: v for k, v in result.items() if k != "curve"}), flush=True)
            results.append(result)
    rows = aggregate(results)
    write_tables(results, rows, out_dir)
    plot(results, rows, out_dir / "isoflop.png")
    plot_time(results, rows, out_dir / "isoflop_time.png")
    print((out_dir / "isoflop.md").read_text())
    return rows
