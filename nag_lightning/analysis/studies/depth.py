"""`nag-lightning study depth`: residual strategies against each other at several depths and seeds.

Every run is `nag-lightning fit` on the same recipe with only `model.arch.n_layers`, `model.arch.residual`,
the seed (and, in a learning-rate sweep, `model.lr`) changed, in its own process and its own folder
under `--out`: `{residual}-L{depth}-s{seed}`, with `-lr{lr}` appended for sweep runs, cached as
every study's runs are (`nag_lightning.analysis.studies.study`).

Fairness between strategies: `--residual_extra` gives each strategy its own `fit` options on top of
`--extra` (e.g. its own learning rate), and `--lrs` sweeps the learning rate per depth instead. A
sweep must not pick and report on the same bytes: every sweep run's last checkpoint is evaluated
on `--split_batches` validation batches (the validation split is read in order, unshuffled); the
learning rate of each (strategy, depth) is picked by the mean over seeds on the first half of those
batches, and the number reported is the second half's. Without a sweep the number reported is the
run's final validation bits per byte.

At the end the study writes:

    depth.csv / depth.md     per run, and per (depth, residual): bits per byte, the gain of
                             `--focus` (NAG unless told) over the best other strategy (and over
                             prenorm), and the spread of the contribution angle (median over
                             sublayers of q10/q90 across tokens)
    depth.png                bits per byte, that gain and the angle spread against depth
    norm_growth.png          state norm and contribution angle against depth, every strategy
"""

from __future__ import annotations

import json
import math
import statistics
import zlib
from pathlib import Path

from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.analysis.studies.study import (
    DEFAULT_RESIDUALS,
    check_study_options,
    find_recipe,
    run_name,
    run_one,
    write_csv,
)


def color(residual: str) -> str:
    """The strategy's colour in every figure: its place among the registry's names on matplotlib's
    palette (a class path outside the registry: a colour of its own name's hash)."""
    from nag_lightning.residuals import RESIDUALS

    names = RESIDUALS.names()
    index = names.index(residual) if residual in names else zlib.crc32(residual.encode())
    return f"C{index % 10}"


def choose(results: list[dict]) -> list[dict]:
    """The runs a study reports, each with `bpb`, the number reported. Without a learning-rate
    sweep: every run, at its final validation bpb. With one: per (depth, residual), the runs of the
    learning rate with the lowest mean `select_bpb` over seeds, at their `report_bpb`."""
    chosen = []
    for depth, residual in dict.fromkeys((r["depth"], r["residual"]) for r in results):
        runs = [r for r in results if r["depth"] == depth and r["residual"] == residual]
        if all("lr" not in r for r in runs):
            chosen += [{**r, "bpb": r["val_bpb"]} for r in runs]
            continue
        by_lr: dict[float, list[dict]] = {}
        for r in runs:
            by_lr.setdefault(r["lr"], []).append(r)
        best = min(by_lr, key=lambda lr: statistics.fmean(r["select_bpb"] for r in by_lr[lr]))
        chosen += [{**r, "bpb": r["report_bpb"]} for r in by_lr[best]]
    return chosen


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(values) if values else None


def summarise(results: list[dict], out: Path, focus: str = "nag") -> list[dict]:
    """Per (depth, residual): mean and spread of the reported bpb, the learning rate picked (sweep),
    the angle spread; per depth, the gain of `focus` over the best other strategy and over prenorm,
    the pre-norm baseline."""
    chosen = choose(results)
    residuals = list(dict.fromkeys(r["residual"] for r in results))
    rows = []
    for depth in sorted({r["depth"] for r in results}):
        row: dict = {"depth": depth}
        for residual in residuals:
            runs = [r for r in chosen if r["depth"] == depth and r["residual"] == residual]
            if not runs:
                continue
            values = [r["bpb"] for r in runs]
            row[f"{residual}_mean"] = statistics.fmean(values)
            row[f"{residual}_min"], row[f"{residual}_max"] = min(values), max(values)
            row[f"{residual}_seeds"] = len(values)
            row[f"{residual}_angle_q10_q90"] = _mean([r["angle_q10_q90"] for r in runs])
            if "lr" in runs[0]:
                row[f"{residual}_lr"] = runs[0]["lr"]
        others = [r for r in residuals if r != focus and f"{r}_mean" in row]
        if f"{focus}_mean" in row and others:
            best = min(others, key=lambda r: row[f"{r}_mean"])
            row["best_other"] = best
            row[f"{focus}_gain"] = row[f"{best}_mean"] - row[f"{focus}_mean"]
            if "prenorm_mean" in row and focus != "prenorm":
                row[f"{focus}_gain_prenorm"] = row["prenorm_mean"] - row[f"{focus}_mean"]
        rows.append(row)
    write_tables(results, rows, out, residuals, focus)
    plot_depth_study(rows, out / "depth.png", chosen, residuals, focus)
    return rows


def write_tables(results: list[dict], rows: list[dict], out: Path, residuals: list[str],
                 focus: str = "nag") -> None:
    write_csv(sorted(results, key=lambda r: (r["depth"], r["residual"], r["seed"], r.get("lr") or 0.0)),
              out / "depth.csv")
    sweep = any("lr" in r for r in results)
    head = [f"{r} bpb (min-max{', lr' if sweep else ''})" for r in residuals]
    head += ["best other", f"{focus} gain over it (bpb)", f"{focus} gain over prenorm (bpb)"]
    head += [f"{r} angle q10/q90" for r in residuals] + ["seeds"]
    lines = ["| depth | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|"]
    for row in rows:
        cells = [str(row["depth"])]
        for residual in residuals:
            if f"{residual}_mean" not in row:
                cells.append("-")
                continue
            lr = f", {row[f'{residual}_lr']:g}" if f"{residual}_lr" in row else ""
            cells.append(f"{row[f'{residual}_mean']:.4f} ({row[f'{residual}_min']:.4f}-"
                         f"{row[f'{residual}_max']:.4f}{lr})")
        cells.append(row.get("best_other", "-"))
        for key in (f"{focus}_gain", f"{focus}_gain_prenorm"):
            cells.append(f"{row[key]:+.4f}" if key in row else "-")
        for residual in residuals:
            spread = row.get(f"{residual}_angle_q10_q90")
            cells.append("-" if spread is None else f"{spread:.3f}")
        cells.append(str(max((row.get(f"{r}_seeds", 0) for r in residuals), default=0)))
        lines.append("| " + " | ".join(cells) + " |")
    (out / "depth.md").write_text("\n".join(lines) + "\n")


def paired_gains(results: list[dict], focus: str = "nag") -> list[tuple[int, float]]:
    """(depth, other bpb - `focus` bpb) for every depth and seed that has both runs, where the other
    is the strategy with the lowest mean bpb at that depth, `focus` aside (prenorm when it is the
    only other). Uses each run's `bpb` (the number a study reports) or else its `val_bpb`."""
    bpb = {(r["residual"], r["depth"], r["seed"]): r.get("bpb", r["val_bpb"]) for r in results}
    means: dict[tuple[str, int], list[float]] = {}
    for (residual, depth, _), value in bpb.items():
        means.setdefault((residual, depth), []).append(value)
    gains = []
    for (residual, depth, seed), value in sorted(bpb.items()):
        others = [(statistics.fmean(v), r) for (r, d), v in means.items() if d == depth and r != focus]
        if residual != focus or not others:
            continue
        best = min(others)[1]
        if (best, depth, seed) in bpb:
            gains.append((depth, bpb[(best, depth, seed)] - value))
    return gains


def plot_depth_study(rows: list[dict], path: Path, results: list[dict] | None = None,
                     residuals: list[str] | None = None, focus: str = "nag") -> None:
    plt = pyplot()
    residuals = residuals or [r for r in DEFAULT_RESIDUALS if any(f"{r}_mean" in row for row in rows)]
    fig, (ax_bpb, ax_gain, ax_spread) = plt.subplots(1, 3, figsize=(15, 4))
    for residual in residuals:
        done = [r for r in rows if f"{residual}_mean" in r]
        depths = [r["depth"] for r in done]
        c = color(residual)
        ax_bpb.plot(depths, [r[f"{residual}_mean"] for r in done], "o-", color=c, label=residual)
        ax_bpb.fill_between(depths, [r[f"{residual}_min"] for r in done],
                            [r[f"{residual}_max"] for r in done], color=c, alpha=0.2)
        spread = [(r["depth"], r[f"{residual}_angle_q10_q90"]) for r in done
                  if r.get(f"{residual}_angle_q10_q90") is not None]
        if spread:
            ax_spread.plot(*zip(*spread), "o-", color=c, label=residual)
    gain, gain_prenorm = f"{focus}_gain", f"{focus}_gain_prenorm"
    gains = [r for r in rows if gain in r]
    ax_gain.axhline(0, color="black", lw=0.8)
    ax_gain.plot([r["depth"] for r in gains], [r[gain] for r in gains], "o-", color=color(focus),
                 label="over the best other (mean over seeds)")
    for r in gains:
        ax_gain.annotate(r["best_other"], (r["depth"], r[gain]), fontsize=7,
                         textcoords="offset points", xytext=(4, 4))
    versus_prenorm = [r for r in gains if gain_prenorm in r and r["best_other"] != "prenorm"]
    if versus_prenorm:
        ax_gain.plot([r["depth"] for r in versus_prenorm], [r[gain_prenorm] for r in versus_prenorm],
                     "s--", color=color("prenorm"), alpha=0.7, label="over prenorm")
    seeds = paired_gains(results or [], focus)
    if seeds:
        ax_gain.plot(*zip(*seeds), "x", color=color(focus), alpha=0.6, label="one seed (paired)")
    ax_gain.legend(fontsize=8)
    for ax in (ax_bpb, ax_gain, ax_spread):
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["depth"] for r in rows], [str(r["depth"]) for r in rows])
    ax_bpb.set(xlabel="blocks", ylabel="bits per byte (reported)",
               title="Depth scaling (band: seed min-max)")
    ax_gain.set(xlabel="blocks", ylabel=f"other bpb - {focus} bpb",
                title=f"{focus} gain over the best other strategy (> 0: {focus} better)")
    ax_spread.set(xlabel="blocks", ylabel="median over sublayers of q10/q90", ylim=(0, 1.05),
                  title="Angle spread across tokens (low: informative)")
    ax_bpb.legend(fontsize=8)
    if ax_spread.lines:
        ax_spread.legend(fontsize=8)
    save(fig, path)


def plot_norm_growth(out: Path, depth: int, seed: int, figure: Path | None = None,
                     runs: dict[str, str] | None = None) -> Path | None:
    """Side by side depth diagnostics of trained runs at one depth, written to `figure` (default:
    out/norm_growth.png); `runs` maps each strategy to its run folder (default: prenorm's and
    NAG's, `run_name(residual, depth, seed)`). None when a run's diagnostics are missing."""
    runs = runs or {residual: run_name(residual, depth, seed) for residual in DEFAULT_RESIDUALS}
    histories = {}
    for residual, name in runs.items():
        path = out / name / "version_0" / "depth_diagnostics.json"
        if not path.is_file():
            return None
        histories[residual] = json.loads(path.read_text())[-1]
    plt = pyplot()

    fig, (ax_norm, ax_angle) = plt.subplots(1, 2, figsize=(11, 4))
    for residual, entry in histories.items():
        x = range(len(entry["labels"]))
        c = color(residual)
        ax_norm.plot(x, entry["norm"], color=c, label=residual)
        ax_angle.plot(x, entry["mean"], color=c, label=f"{residual} mean")
        ax_angle.fill_between(x, entry["q0.1"], entry["q0.9"], color=c, alpha=0.15)
    ax_norm.set(xlabel="sublayer (depth)",
                ylabel="state norm (|x|/sqrt(d); NAG exp(rho); nGPT 1)",
                yscale="log", title=f"State norm after each sublayer, {depth} blocks")
    ax_angle.set(xlabel="sublayer (depth)", ylabel="contribution angle (rad)", yscale="log",
                 title="Angle each sublayer turns the state (band: 10-90%)")
    ax_norm.legend(fontsize=8)
    ax_angle.legend(fontsize=8)
    return save(fig, figure or out / "norm_growth.png")


def check_options(residuals: list[str], residual_extra: dict[str, list[str]],
                  lrs: dict[str, list[float]]) -> None:
    """One sentence for a bad study option, before any run."""
    from nag_lightning.residuals import RESIDUALS

    for residual in residuals:
        RESIDUALS.get(residual)  # an unknown name fails with the registered ones listed
    if len(set(residuals)) != len(residuals):
        raise ValueError(f"--residuals names a strategy twice: {residuals}; list each once.")
    for option, given in (("--residual_extra", residual_extra), ("--lrs", lrs)):
        unknown = sorted(set(given) - set(residuals))
        if unknown:
            raise ValueError(
                f"{option} gives options for {unknown}, which --residuals {residuals} does not "
                "run; add them to --residuals or drop their options."
            )
    if any(lr <= 0 for grid in lrs.values() for lr in grid):
        raise ValueError(f"Every learning rate in --lrs must be positive; got {lrs}.")


def depth_study(
    recipe: str = "recipes/study/depth.yaml",
    out: str = "runs/study/depth",
    depths: list[int] = [4, 8, 16, 32],  # noqa: B006 - jsonargparse reads the default as data
    seeds: list[int] = [1, 2],  # noqa: B006
    residuals: list[str] = list(DEFAULT_RESIDUALS),  # noqa: B006
    extra: list[str] = [],  # noqa: B006
    residual_extra: dict[str, list[str]] = {},  # noqa: B006
    lrs: list[float] | dict[str, list[float]] = [],  # noqa: B006
    split_batches: int = 64,
    trust_checkpoint: bool = False,
    focus: str = "nag",
) -> list[dict]:
    """Run residual strategies at each depth and seed, then write tables and figures.

    Args:
        recipe: the fit recipe every run shares.
        out: folder for the runs, tables and figures.
        depths: numbers of blocks to train.
        seeds: seeds per (depth, residual); at least 2 before drawing a conclusion.
        residuals: residual strategies to compare, any registered ones (prenorm, nag, lns, periln,
            ngpt, ...).
        extra: further `fit` arguments passed to every run, e.g. ["--trainer.max_steps=100"].
        residual_extra: further `fit` arguments per strategy, after `extra`, e.g.
            {nag: ["--model.lr=1.2e-2"], prenorm: ["--model.lr=6e-3"]}.
        lrs: learning rates to sweep at every depth (empty: no sweep), one list for every strategy
            or one per strategy, e.g. {prenorm: [6e-3], nag: [6e-3, 1.2e-2]} (a strategy left out
            is not swept); each (strategy, depth) reports the one that does best on a selection
            half of the validation batches, on the other half. A sweep's --model.lr overrides one
            in extra or residual_extra.
        split_batches: validation batches of a sweep's selection and report halves together.
        trust_checkpoint: let a sweep run's checkpoint, read back for the selection, import and
            call a residual or router class path outside the registered plugins (your own
            --residuals or extra options); only for run folders whose origin you trust.
        focus: the strategy whose gain over the best other (and over prenorm) the table and the
            figure report, per depth.
    """
    check_study_options(depths=depths, seeds=seeds, residuals=residuals)
    recipe = find_recipe(recipe)
    if not isinstance(lrs, dict):
        lrs = {residual: list(lrs) for residual in residuals} if lrs else {}
    check_options(residuals, residual_extra, lrs)
    out_dir = Path(out)
    results = []
    for seed in seeds:  # seed-major: a partial study already has one seed of every point
        for depth in depths:
            for residual in residuals:
                for lr in lrs.get(residual) or [None]:
                    result = run_one(recipe, out_dir, residual, depth, seed,
                                     [*extra, *residual_extra.get(residual, [])], lr, split_batches,
                                     trust_checkpoint)
                    print(json.dumps(result), flush=True)
                    results.append(result)
    rows = summarise(results, out_dir, focus)
    deepest = [r for r in choose(results) if r["depth"] == max(depths) and r["seed"] == seeds[0]]
    plot_norm_growth(out_dir, max(depths), seeds[0],
                     runs={r["residual"]: run_name(r["residual"], r["depth"], r["seed"], r.get("lr"))
                           for r in deepest})
    print((out_dir / "depth.md").read_text())
    return rows
