"""`nag-lightning study tradeoff`: the post-training accuracy/compute curve of prenorm and NAG.

For each residual strategy and seed it takes the depth study's trained run at one depth (training
it first, in the depth study's folder, if the study has not), runs `nag-lightning sweep` on its
last checkpoint (threshold probes fitted on the frozen model, then tau swept), and puts every
curve on one plot. Finished sweeps are cached. It writes, into `--out`:

    tradeoff.csv   every evaluated setting of every model (the rows of each sweep.csv)
    tradeoff.md    per residual: full-depth bpb and what skipping 10, 20 and 25% costs
    tradeoff.png   bits per byte against the executed fraction of forward FLOPs, both residuals
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from nag_lightning.analysis.checks import check_at_least_one
from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.analysis.studies.study import DEFAULT_RESIDUALS, check_study_options, run_name, run_one
from nag_lightning.analysis.sweeps.report import ORACLE

RATES = (0.1, 0.2, 0.25)


def sweep_run(ckpt: Path, out: Path, val_batches: int, fit_batches: int,
              trust_checkpoint: bool = False, router_options: dict | None = None) -> list[dict]:
    """The sweep of one checkpoint, as CSV rows with numbers (cached in out/sweep.csv)."""
    table = out / "sweep.csv"
    if not table.is_file():
        from nag_lightning.analysis.sweeps.sweep import sweep

        # the depth study's runs were trained on the data its options named: their data settings hold
        sweep(str(ckpt), out_dir=str(out), val_batches=val_batches, fit_batches=fit_batches,
              trust_checkpoint=trust_checkpoint, router_options=router_options, own_run=True)
    with table.open() as handle:
        return [{k: (v if k in ("method", "setting") else float(v or "nan")) for k, v in row.items()}
                for row in csv.DictReader(handle)]


def full_depth_bpb(rows: list[dict]) -> float:
    """The bpb at the smallest MoD rate swept, 0: tau = 0 skips nothing."""
    return min((r["mod_rate"], r["bpb"]) for r in rows)[1]


def cost_at_rate(rows: list[dict], method: str, rate: float) -> float:
    """bpb increase over the full-depth model at MoD rate `rate`, interpolated along the sweep."""
    points = sorted((r["mod_rate"], r["bpb"]) for r in rows if r["method"] == method)
    if not points:
        return float("nan")  # not swept (no oracle for a setting that is no angle)
    dense = points[0][1]  # sorted: the smallest rate swept, 0, where tau = 0 skips nothing
    for (r0, b0), (r1, b1) in zip(points, points[1:]):
        if r0 <= rate <= r1:
            return (b0 if r1 == r0 else b0 + (b1 - b0) * (rate - r0) / (r1 - r0)) - dense
    return float("nan")  # the sweep did not reach this rate


def swept_method(rows: list[dict]) -> str:
    """The name of the router a sweep varied (threshold for models trained without routing)."""
    return next(r["method"] for r in rows if r["method"] != ORACLE)


def write_tables(curves: dict[tuple[str, int], list[dict]], out: Path) -> None:
    with (out / "tradeoff.csv").open("w", newline="") as handle:
        first = next(iter(curves.values()))[0]
        writer = csv.DictWriter(handle, fieldnames=["residual", "seed", *first])
        writer.writeheader()
        for (residual, seed), rows in curves.items():
            writer.writerows({"residual": residual, "seed": seed, **row} for row in rows)
    head = " | ".join(f"+bpb at {100 * r:.0f}% ({m})" for r in RATES for m in ("router", "oracle"))
    lines = [f"| residual | seeds | full-depth bpb | {head} |", "|" + "---|" * (3 + 2 * len(RATES))]
    for residual in dict.fromkeys(r for r, _ in curves):
        runs = [rows for (r, _), rows in curves.items() if r == residual]
        dense = statistics.fmean(full_depth_bpb(rows) for rows in runs)
        cells = []
        for rate in RATES:
            for method in (swept_method(runs[0]), ORACLE):
                costs = [cost_at_rate(rows, method, rate) for rows in runs]
                cells.append(f"{statistics.fmean(costs):+.3f} ({min(costs):+.3f} to {max(costs):+.3f})")
        lines.append(f"| {residual} | {len(runs)} | {dense:.4f} | " + " | ".join(cells) + " |")
    (out / "tradeoff.md").write_text("\n".join(lines) + "\n")


def plot(curves: dict[tuple[str, int], list[dict]], path: Path, depth: int) -> Path:
    """Left: bits per byte against the executed fraction of forward FLOPs. Right: the increase
    over the same model at full depth against the MoD rate. One line per model and method."""
    plt = pyplot()
    fig, (ax_abs, ax_cost) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {"prenorm": "tab:gray", "nag": "tab:blue"}
    labelled = set()
    for (residual, _), rows in curves.items():
        color = colors.get(residual, None)
        dense = full_depth_bpb(rows)
        router = swept_method(rows)
        for method, style in ((router, "o-"), (ORACLE, "s:")):
            # Past a 70% MoD rate nothing useful is left to compare, and it squashes the axes.
            points = sorted((r["executed_fraction"], r["mod_rate"], r["bpb"]) for r in rows
                            if r["method"] == method and r["mod_rate"] <= 0.7)
            label = None if (residual, method) in labelled else (
                f"{residual}, " + (f"{router} router" if method == router else
                                   "oracle (skips on the measured angle; saves nothing)"))
            labelled.add((residual, method))
            if not points:
                continue
            fraction, rate, bpb = zip(*points)
            style_args = dict(color=color, markersize=4, lw=1.2, alpha=0.9 if method == router else 0.6)
            ax_abs.plot(fraction, bpb, style, label=label, **style_args)
            ax_cost.plot(rate, [b - dense for b in bpb], style, **style_args)
    ax_abs.invert_xaxis()  # left to right: more compute saved
    ax_abs.set(xlabel="executed fraction of full-depth forward FLOPs", ylabel="validation bits per byte",
               title=f"Post-training skipping, {depth} blocks (one line per seed)")
    ax_cost.set(xlabel="MoD rate (skipped sublayer executions)", ylabel="bits per byte over full depth",
                title="What skipping costs")
    for ax in (ax_abs, ax_cost):
        ax.grid(alpha=0.3)
    ax_abs.legend(fontsize=8)
    return save(fig, path)


def tradeoff_study(
    depth: int = 16,
    seeds: list[int] = [1, 2],  # noqa: B006 - jsonargparse reads the default as data
    residuals: list[str] = list(DEFAULT_RESIDUALS),  # noqa: B006
    depth_out: str = "runs/study/depth",
    recipe: str = "recipes/study/depth.yaml",
    out: str = "runs/study/tradeoff",
    val_batches: int = 16,
    fit_batches: int = 32,
    extra: list[str] = [],  # noqa: B006
    lrs: dict[str, float] = {},  # noqa: B006
    trust_checkpoint: bool = False,
    router_options: dict[str, dict] = {},  # noqa: B006
) -> dict[tuple[str, int], list[dict]]:
    """Sweep post-training skipping on trained prenorm and NAG models; one plot, one table.

    Args:
        depth: blocks of the models (a depth of the depth study).
        seeds: seeds per residual; at least 2 before drawing a conclusion.
        residuals: residual strategies to compare.
        depth_out: the depth study's folder, where the trained runs are (or are trained).
        recipe: the depth study's recipe, to train a missing run.
        out: folder for the sweeps, table and figure.
        val_batches: validation batches every setting is evaluated on.
        fit_batches: training batches the threshold probes are fitted on.
        extra: further `fit` arguments for a run that has to be trained.
        lrs: per residual, the learning rate of its run when the depth study swept learning rates
            (its runs are named by it), e.g. {prenorm: 6e-3, nag: 1.2e-2}.
        trust_checkpoint: let the runs' checkpoints, read back for the sweeps, import and call a
            residual or router class path outside the registered plugins (your own --residuals or
            extra options); only for run folders whose origin you trust.
        router_options: per residual, options of the routers its sweeps attach, e.g. {nag:
            {predictor: angle}} to skip on NAG's own gated angle instead of a fitted probe. Sweeps
            are cached by run name in `out`: give another `out` when these change.
    """
    check_study_options(seeds=seeds, residuals=residuals)
    check_at_least_one(depth=depth, val_batches=val_batches, fit_batches=fit_batches)
    out_dir = Path(out)
    curves = {}
    for seed in seeds:
        for residual in residuals:
            run_one(recipe, Path(depth_out), residual, depth, seed, extra, lrs.get(residual))
            name = run_name(residual, depth, seed, lrs.get(residual))
            ckpt = Path(depth_out) / name / "version_0" / "checkpoints" / "last.ckpt"
            curves[(residual, seed)] = sweep_run(ckpt, out_dir / name, val_batches, fit_batches,
                                                 trust_checkpoint, router_options.get(residual))
            print(json.dumps({"run": name, "points": len(curves[(residual, seed)])}), flush=True)
    write_tables(curves, out_dir)
    plot(curves, out_dir / "tradeoff.png", depth)
    print((out_dir / "tradeoff.md").read_text())
    return curves
