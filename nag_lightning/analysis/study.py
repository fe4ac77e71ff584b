"""`nag-lightning study depth`: pre-norm against NAG at several depths and seeds, one command.

Every run is `nag-lightning fit` on the same recipe with only `model.n_layers`, `model.residual`
and the seed changed, in its own process (a crash costs one run, not the study) and its own folder
under `--out`. A finished run (one whose `result.json` exists) is not run again, so an interrupted
study resumes where it stopped. At the end the study writes:

    depth.csv / depth.md     final validation bits per byte, per run and per (depth, residual)
    depth.png                bits per byte against depth, and the NAG gain against depth
    norm_growth.png          state norm and contribution angle against depth, prenorm beside NAG
"""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from nag_lightning.plotting import pyplot, save

RESIDUALS = ("prenorm", "nag")


def run_name(residual: str, depth: int, seed: int) -> str:
    return f"{residual}-L{depth}-s{seed}"


def final_val_bpb(metrics_csv: Path) -> tuple[float, int]:
    """The last logged validation bits per byte and its step, from a CSVLogger file."""
    last = None
    with metrics_csv.open() as handle:
        for row in csv.DictReader(handle):
            if row.get("val/bpb"):
                last = (float(row["val/bpb"]), int(row["step"]))
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


def check_recipe(recipe: str) -> None:
    if not Path(recipe).is_file():
        raise FileNotFoundError(
            f"No recipe at {recipe} (relative paths start at {Path.cwd()}); run from the repository "
            "root or give the path of a fit YAML file."
        )


def run_one(recipe: str, out: Path, residual: str, depth: int, seed: int, extra: list[str]) -> dict:
    """One point of the depth study (cached like every `fit_run`)."""
    name = run_name(residual, depth, seed)
    if not (out / name / "result.json").is_file():
        check_recipe(recipe)  # a cached run needs no recipe
    args = ["--config", recipe, f"--model.n_layers={depth}", f"--model.residual={residual}",
            f"--seed_everything={seed}", *extra]
    result = fit_run(out, name, args)
    return {"residual": residual, "depth": depth, "seed": seed, **result}


def summarise(results: list[dict], out: Path) -> list[dict]:
    """Per (depth, residual): mean and spread of final val bpb; the NAG gain per depth."""
    rows = []
    for depth in sorted({r["depth"] for r in results}):
        row: dict = {"depth": depth}
        for residual in RESIDUALS:
            values = [r["val_bpb"] for r in results if r["depth"] == depth and r["residual"] == residual]
            if values:
                row[f"{residual}_mean"] = statistics.fmean(values)
                row[f"{residual}_min"], row[f"{residual}_max"] = min(values), max(values)
                row[f"{residual}_seeds"] = len(values)
        if "prenorm_mean" in row and "nag_mean" in row:
            row["nag_gain"] = row["prenorm_mean"] - row["nag_mean"]
        rows.append(row)
    write_tables(results, rows, out)
    plot_depth_study(rows, out / "depth.png", results)
    return rows


def write_tables(results: list[dict], rows: list[dict], out: Path) -> None:
    with (out / "depth.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(results[0]))
        writer.writeheader()
        writer.writerows(sorted(results, key=lambda r: (r["depth"], r["residual"], r["seed"])))
    lines = ["| depth | prenorm bpb (min-max) | NAG bpb (min-max) | NAG gain (bpb) | seeds |",
             "|---|---|---|---|---|"]
    for row in rows:
        cells = []
        for residual in RESIDUALS:
            if f"{residual}_mean" in row:
                cells.append(f"{row[f'{residual}_mean']:.4f} ({row[f'{residual}_min']:.4f}-"
                             f"{row[f'{residual}_max']:.4f})")
            else:
                cells.append("-")
        gain = f"{row['nag_gain']:+.4f}" if "nag_gain" in row else "-"
        seeds = row.get("nag_seeds", row.get("prenorm_seeds", 0))
        lines.append(f"| {row['depth']} | {cells[0]} | {cells[1]} | {gain} | {seeds} |")
    (out / "depth.md").write_text("\n".join(lines) + "\n")


def paired_gains(results: list[dict]) -> list[tuple[int, float]]:
    """(depth, prenorm bpb - NAG bpb) for every depth and seed that has both runs."""
    bpb = {(r["residual"], r["depth"], r["seed"]): r["val_bpb"] for r in results}
    return [(depth, bpb[("prenorm", depth, seed)] - value)
            for (residual, depth, seed), value in sorted(bpb.items())
            if residual == "nag" and ("prenorm", depth, seed) in bpb]


def plot_depth_study(rows: list[dict], path: Path, results: list[dict] | None = None) -> None:
    plt = pyplot()

    fig, (ax_bpb, ax_gain) = plt.subplots(1, 2, figsize=(10, 4))
    for residual, color in zip(RESIDUALS, ("tab:gray", "tab:blue")):
        done = [r for r in rows if f"{residual}_mean" in r]
        depths = [r["depth"] for r in done]
        ax_bpb.plot(depths, [r[f"{residual}_mean"] for r in done], "o-", color=color, label=residual)
        ax_bpb.fill_between(depths, [r[f"{residual}_min"] for r in done],
                            [r[f"{residual}_max"] for r in done], color=color, alpha=0.2)
    gains = [r for r in rows if "nag_gain" in r]
    ax_gain.axhline(0, color="black", lw=0.8)
    ax_gain.plot([r["depth"] for r in gains], [r["nag_gain"] for r in gains], "o-", color="tab:blue",
                 label="mean over seeds")
    seeds = paired_gains(results or [])
    if seeds:
        ax_gain.plot(*zip(*seeds), "x", color="tab:blue", alpha=0.6, label="one seed (paired)")
        ax_gain.legend(fontsize=8)
    for ax in (ax_bpb, ax_gain):
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["depth"] for r in rows], [str(r["depth"]) for r in rows])
    ax_bpb.set(xlabel="blocks", ylabel="final validation bits per byte",
               title="Depth scaling (band: seed min-max)")
    ax_gain.set(xlabel="blocks", ylabel="prenorm bpb - NAG bpb",
                title="NAG gain over prenorm (> 0: NAG better)")
    ax_bpb.legend()
    save(fig, path)


def plot_norm_growth(out: Path, depth: int, seed: int, figure: Path | None = None) -> Path | None:
    """Side by side depth diagnostics of the trained prenorm and NAG runs at one depth, written to
    `figure` (default: out/norm_growth.png); None when a run's diagnostics are missing."""
    histories = {}
    for residual in RESIDUALS:
        path = out / run_name(residual, depth, seed) / "version_0" / "depth_diagnostics.json"
        if not path.is_file():
            return None
        histories[residual] = json.loads(path.read_text())[-1]
    plt = pyplot()

    fig, (ax_norm, ax_angle) = plt.subplots(1, 2, figsize=(11, 4))
    for (residual, entry), color in zip(histories.items(), ("tab:gray", "tab:blue")):
        x = range(len(entry["labels"]))
        ax_norm.plot(x, entry["norm"], color=color, label=residual)
        ax_angle.plot(x, entry["mean"], color=color, label=f"{residual} mean")
        ax_angle.fill_between(x, entry["q0.1"], entry["q0.9"], color=color, alpha=0.2)
    ax_norm.set(xlabel="sublayer (depth)", ylabel="state norm (prenorm |x|/sqrt(d), NAG exp(rho))",
                yscale="log", title=f"State norm after each sublayer, {depth} blocks")
    ax_angle.set(xlabel="sublayer (depth)", ylabel="contribution angle (rad)", yscale="log",
                 title="Angle each sublayer turns the state (band: 10-90%)")
    ax_norm.legend()
    ax_angle.legend()
    return save(fig, figure or out / "norm_growth.png")


def depth_study(
    recipe: str = "recipes/study/depth.yaml",
    out: str = "runs/study/depth",
    depths: list[int] = [4, 8, 16, 32],  # noqa: B006 - jsonargparse reads the default as data
    seeds: list[int] = [1, 2],  # noqa: B006
    residuals: list[str] = list(RESIDUALS),  # noqa: B006
    extra: list[str] = [],  # noqa: B006
) -> list[dict]:
    """Run pre-norm and NAG at each depth and seed, then write tables and figures.

    Args:
        recipe: the fit recipe every run shares.
        out: folder for the runs, tables and figures.
        depths: numbers of blocks to train.
        seeds: seeds per (depth, residual); at least 2 before drawing a conclusion.
        residuals: residual strategies to compare.
        extra: further `fit` arguments passed to every run, e.g. ["--trainer.max_steps=100"].
    """
    check_recipe(recipe)
    out_dir = Path(out)
    results = []
    for seed in seeds:  # seed-major: a partial study already has one seed of every point
        for depth in depths:
            for residual in residuals:
                result = run_one(recipe, out_dir, residual, depth, seed, extra)
                print(json.dumps(result), flush=True)
                results.append(result)
    rows = summarise(results, out_dir)
    plot_norm_growth(out_dir, max(depths), seeds[0])
    print((out_dir / "depth.md").read_text())
    return rows


STUDIES = {
    "depth": "nag_lightning.analysis.study:depth_study",
    "isoflop": "nag_lightning.analysis.isoflop_study:isoflop_study",
    "tradeoff": "nag_lightning.analysis.tradeoff_study:tradeoff_study",
}


def _study_function(name: str):
    import importlib

    module, _, function = STUDIES[name].partition(":")
    return getattr(importlib.import_module(module), function)


def _summary(function) -> str:
    """The docstring without its Args section, which the option list already shows."""
    return function.__doc__.split("Args:")[0].strip()


def studies_help() -> str:
    lines = [f"usage: nag-lightning study {{{','.join(STUDIES)}}} [options]   (each takes --help)", ""]
    lines += [f"  {name:<10} {_summary(_study_function(name)).splitlines()[0]}" for name in STUDIES]
    return "\n".join(lines) + "\n"


def study_command(args: list[str]) -> None:
    """`nag-lightning study {depth,isoflop,tradeoff} [options]`."""
    from jsonargparse import ArgumentParser

    if args and args[0] in ("-h", "--help"):
        print(studies_help(), end="")
        return
    if not args or args[0] not in STUDIES:
        raise ValueError(
            f"Name the study to run, one of {', '.join(STUDIES)}: e.g. `nag-lightning study depth --help`."
        )
    function = _study_function(args[0])
    parser = ArgumentParser(prog=f"nag-lightning study {args[0]}", description=_summary(function))
    parser.add_function_arguments(function)
    function(**parser.parse_args(args[1:]).as_dict())
