"""`nag-lightning study tradeoff_tasks`: what skipping after training costs each difficulty level
of a synthetic task (`nag_lightning.tasks`: -1 unpredictable, 0 format, k = k steps).

For each residual strategy and seed it takes the full-depth (unrouted) run of a `study tasks`
folder, `<residual>-L<depth>-s<seed>[-<run_label>]`, and attaches the routers `nag-lightning sweep`
attaches (`analysis.sweeps.sweep.sweep_routers`): threshold routers on every sublayer, each a
probe fitted on the run's first training batches with the model frozen, or, with
`--router_options {predictor: angle}`, NAG's own gated angle with nothing to fit. The routers run
in eval mode, so a skipped token is not computed. At every tau of the sweep's grid the run's
last checkpoint is evaluated by difficulty level (`nag_lightning.tasks.evaluation`) on
`--eval_sequences` fresh sequences of its task from seed `--eval_seed`: the sequences `study
tasks` evaluates its runs on with the same options. Nothing is written into the runs' folder;
each run's sweep is cached in `out/<run>/tradeoff_tasks.json` with the options it was made with,
so a rerun with the same options reads it back. It writes, into `--out`:

    tradeoff_tasks.csv   one row per run, setting and level: the method ("full": the run as
                         trained, no router; else the router swept), tau, the MoD rate and the
                         executed fraction of full-depth forward FLOPs over all tokens, and the
                         level's count, accuracy, loss and skip rate
    tradeoff_tasks.md    per residual, mean over seeds: accuracy per level at full depth and at
                         MoD rates of 10, 25 and 50%, and each level's skip rate there
    tradeoff_tasks.png   accuracy (top) and skip rate (bottom) per level against the MoD rate,
                         one panel per residual, one line per level and seed
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import yaml

from nag_lightning.analysis.checks import check_at_least_one, check_device
from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.analysis.studies.study import (
    DEFAULT_RESIDUALS,
    check_study_options,
    markdown_table,
    run_name,
    write_csv,
)
from nag_lightning.analysis.studies.tasks import task_settings

RATES = (0.1, 0.25, 0.5)
"""The MoD rates tradeoff_tasks.md reads every curve at."""

FULL = "full"
"""The method of the rows of a run evaluated as trained, before any router is attached."""

LEVEL_KEYS = ("level", "name", "count", "accuracy", "loss", "skip_rate")
"""What a row keeps of each level of `level_table`."""


def full_depth_run(runs_dir: Path, residual: str, depth: int, seed: int, label: str) -> Path:
    """The folder of a finished run trained without a router, or one sentence why there is none."""
    name = run_name(residual, depth, seed) + (f"-{label}" if label else "")
    config = runs_dir / name / "version_0" / "config.yaml"
    if not config.is_file() or not (config.parent / "checkpoints" / "last.ckpt").is_file():
        routers = f" --routers '{{{label}: []}}'" if label else ""
        raise FileNotFoundError(
            f"No finished run {name} in {runs_dir}; train it with `nag-lightning study tasks --out "
            f"{runs_dir} --residuals '[{residual}]' --depths '[{depth}]' --seeds '[{seed}]'{routers}` (and "
            "the recipe and options of your other runs).")
    router = (yaml.safe_load(config.read_text()) or {}).get("model", {}).get("arch", {}).get("router", "none")
    if router != "none":
        raise ValueError(f"The run {name} was trained with the router {router!r}, and the task trade-off is "
                         "that of skipping added to a model trained at full depth: give --run_label of the "
                         "runs trained without a router.")
    return runs_dir / name


def sweep_run(run: Path, eval_sequences: int, eval_seed: int, fit_batches: int, fit_lr: float,
              router_options: dict | None, device: str = "cpu", trust_checkpoint: bool = False) -> list[dict]:
    """The rows of one run: each level as trained, then at every tau of the sweep."""
    import torch

    from nag_lightning.analysis.evaluation.checkpoint import checkpoint_data, first_batches
    from nag_lightning.analysis.sweeps.sweep import routing_at, sweep_routers, sweep_values
    from nag_lightning.checkpoints.loading import load_model
    from nag_lightning.model.flops import full_depth_forward_flops
    from nag_lightning.registry import plugin_name
    from nag_lightning.tasks.evaluation import evaluate_by_difficulty, task_sequences

    task, options, seq_len = task_settings(run / "version_0" / "config.yaml")
    loaded = load_model(run / "version_0" / "checkpoints" / "last.ckpt", device, trust_checkpoint)
    model = loaded.model
    sequences = task_sequences(task, options, eval_sequences, seq_len + 1, eval_seed)
    dense = full_depth_forward_flops(model.cfg, seq_len) / seq_len
    rows: list[dict] = []

    def add(method: str, tau: float | None) -> None:
        report = evaluate_by_difficulty(model, sequences)
        point = {"method": method, "tau": tau, "mod_rate": report.mod_rate,
                 "executed_fraction": report.flops_per_token / dense}
        rows.extend({**point, **{key: level[key] for key in LEVEL_KEYS}} for level in report.rows)

    add(FULL, None)
    # the probes learn from the run's own training stream, as `sweep` fits them; a task file the
    # run names is read only when the user trusts the runs' folder (the folder may be anyone's)
    data = checkpoint_data(loaded, use_saved_files=trust_checkpoint)
    fit = first_batches(data.train_dataloader(), fit_batches)
    torch.manual_seed(0)  # the probes' initialisation: `sweep`'s default seed
    routers, adapter = sweep_routers(model, fit, None, fit_lr, router_options)
    for tau in sweep_values(model, routers, adapter, fit[0]):
        with routing_at(adapter, routers, tau):
            add(plugin_name(type(routers[0])), tau)
    return rows


def cached_sweep(run: Path, out: Path, settings: dict, device: str, trust_checkpoint: bool) -> list[dict]:
    """`sweep_run` of `run` with `settings`, cached in out/<run>/tradeoff_tasks.json (made again
    when it was made with other settings)."""
    path = out / run.name / "tradeoff_tasks.json"
    if path.is_file():
        cached = json.loads(path.read_text())
        if cached["settings"] == settings:
            return cached["rows"]
    rows = sweep_run(run, **settings, device=device, trust_checkpoint=trust_checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "rows": rows}))
    return rows


def _order(level: int) -> int:
    return level if level >= 0 else 1 << 20  # format, k1, k2, ..., then unpredictable


def levels_of(rows: list[dict]) -> list[tuple[int, str]]:
    return sorted({(r["level"], r["name"]) for r in rows}, key=lambda item: _order(item[0]))


def at_rate(rows: list[dict], rate: float | None) -> dict | None:
    """One run read at MoD rate `rate`: per level name its accuracy and skip rate, and the
    executed FLOP fraction, linearly interpolated in the MoD rate between the two swept settings
    around it; None when the sweep did not reach it. `rate` None: the run as trained."""
    settings: dict[tuple, list[dict]] = {}
    for row in rows:
        if (row["method"] == FULL) == (rate is None):
            settings.setdefault((row["method"], row["tau"]), []).append(row)
    points = sorted(settings.values(), key=lambda levels: levels[0]["mod_rate"])
    if rate is None:
        below = above = points[0]
    else:
        pairs = [(a, b) for a, b in zip(points, points[1:]) if a[0]["mod_rate"] <= rate <= b[0]["mod_rate"]]
        if not pairs:
            return None
        below, above = pairs[0]
    r0, r1 = below[0]["mod_rate"], above[0]["mod_rate"]
    share = 0.0 if r1 == r0 else (rate - r0) / (r1 - r0)

    def mix(a, b):
        return None if a is None or b is None else a + share * (b - a)

    upper = {r["name"]: r for r in above}
    read = {"executed_fraction": mix(below[0]["executed_fraction"], above[0]["executed_fraction"])}
    for r in below:
        read[r["name"]] = (mix(r["accuracy"], upper[r["name"]]["accuracy"]),
                           mix(r["skip_rate"], upper[r["name"]]["skip_rate"]))
    return read


def _mean(values: list) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.fmean(kept) if kept else None


def write_table(curves: dict[tuple[str, int], list[dict]], path: Path) -> None:
    """tradeoff_tasks.md: per residual and rate, each level's accuracy and skip rate, mean over seeds."""
    levels = levels_of([r for rows in curves.values() for r in rows])
    cells = []
    for residual in dict.fromkeys(r for r, _ in curves):
        runs = [rows for (r, _), rows in curves.items() if r == residual]
        for rate in (None, *RATES):
            reads = [read for rows in runs if (read := at_rate(rows, rate)) is not None]
            row = [residual, f"{len(reads)}/{len(runs)}", "full depth" if rate is None else f"{rate:.0%}"]
            fraction = _mean([read["executed_fraction"] for read in reads])
            row.append("-" if fraction is None else f"{fraction:.3f}")
            for _, name in levels:
                accuracy = _mean([read[name][0] for read in reads if name in read])
                skip = _mean([read[name][1] for read in reads if name in read])
                row.append("-" if skip is None else
                           ("-" if accuracy is None else f"{accuracy:.3f}") + f" ({skip:.0%})")
            cells.append(row)
    head = ["residual", "seeds", "MoD rate", "FLOP fraction", *(name for _, name in levels)]
    note = ("\nEach level: exact-match accuracy (the share of that level's tokens' sublayer executions "
            "skipped), mean over the seeds whose sweep reached the rate (seeds: reached / runs). At a MoD "
            "rate, every number of a run is linearly interpolated in its overall MoD rate between the two "
            "swept taus around that rate (tradeoff_tasks.csv holds the measured settings); full depth: the "
            "run as trained, without routers. FLOP fraction: executed forward FLOPs over those at full "
            "depth. Unpredictable tokens have no accuracy, only a skip rate.\n")
    path.write_text(markdown_table(head, cells) + note)


def plot(curves: dict[tuple[str, int], list[dict]], path: Path) -> Path:
    """Accuracy (top) and skip rate (bottom) of each level against the MoD rate, a panel per residual."""
    plt = pyplot()
    residuals = list(dict.fromkeys(r for r, _ in curves))
    fig, axes = plt.subplots(2, len(residuals), figsize=(5 * len(residuals), 7.5), squeeze=False,
                             sharex=True, sharey="row")
    levels = levels_of([r for rows in curves.values() for r in rows])
    colors = plt.get_cmap("viridis")
    for column, residual in enumerate(residuals):
        for seed_index, rows in enumerate(rows for (r, _), rows in curves.items() if r == residual):
            swept = sorted((r for r in rows if r["method"] != FULL), key=lambda r: r["mod_rate"])
            for index, (level, name) in enumerate(levels):
                mine = [r for r in swept if r["name"] == name]
                color = "black" if level == 0 else colors(index / len(levels))
                style = dict(color=color, ls="--" if level == 0 else "-", marker="o", ms=3,
                             label=name if seed_index == 0 else None)
                x = [r["mod_rate"] for r in mine]
                if level >= 0:  # unpredictable tokens have no accuracy
                    axes[0][column].plot(x, [r["accuracy"] for r in mine], **style)
                axes[1][column].plot(x, [r["skip_rate"] for r in mine], **style)
        axes[0][column].set(title=residual, ylim=(-0.02, 1.02))
        axes[1][column].set(xlabel="MoD rate (skipped sublayer executions, all tokens)")
        for ax in axes[:, column]:
            ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("exact-match accuracy")
    axes[1][0].set_ylabel("the level's skip rate")
    axes[1][-1].legend(fontsize=7, title="difficulty")  # every level (the top row lacks unpredictable)
    return save(fig, path)


def tradeoff_tasks_study(
    runs_dir: str = "runs/study/tasks",
    run_label: str = "",
    depth: int = 8,
    seeds: list[int] = [1],  # noqa: B006 - jsonargparse reads the default as data
    residuals: list[str] = list(DEFAULT_RESIDUALS),  # noqa: B006
    router_options: dict[str, dict] = {},  # noqa: B006
    eval_sequences: int = 512,
    eval_seed: int = 1000,
    fit_batches: int = 32,
    fit_lr: float = 1e-2,
    out: str = "runs/study/tradeoff_tasks",
    device: str = "cpu",
    trust_checkpoint: bool = False,
) -> dict[tuple[str, int], list[dict]]:
    """Sweep post-training skipping on the full-depth runs of a task study, by difficulty level.

    Args:
        runs_dir: the `study tasks` folder (its --out) that holds the runs.
        run_label: the label of the runs after their name, e.g. "full" for runs named
            nag-L8-s1-full (`study tasks --routers '{full: []}'`); empty: runs named nag-L8-s1.
        depth: blocks of the runs.
        seeds: seeds per residual; at least 2 before drawing a conclusion.
        residuals: residual strategies to compare.
        router_options: per residual, options of the threshold routers attached, e.g. {nag:
            {predictor: angle}} to skip on NAG's own gated angle; a residual left out gets a probe
            fitted with the model frozen.
        eval_sequences: task sequences every setting is evaluated on.
        eval_seed: seed of those sequences; `study tasks` evaluated its runs on those of its own
            --eval_seed (1000 by default) and --eval_sequences.
        fit_batches: training batches the probes are fitted on.
        fit_lr: Adam learning rate of that fit.
        out: folder for the cached sweeps, the table, the CSV and the figure.
        device: where to evaluate ("cpu", "cuda").
        trust_checkpoint: let the runs' checkpoints name a residual or router by a class path
            outside the registered plugins; only for run folders whose origin you trust.
    """
    check_study_options(seeds=seeds, residuals=residuals)
    check_at_least_one(depth=depth, eval_sequences=eval_sequences, fit_batches=fit_batches)
    check_device(device)
    if not fit_lr > 0:
        raise ValueError(f"--fit_lr={fit_lr} is not a learning rate; give a positive one (e.g. 1e-2).")
    if "/" in run_label:
        raise ValueError(f"--run_label is the end of the runs' folder names, without '/'; got {run_label!r}.")
    unknown = sorted(set(router_options) - set(residuals))
    if unknown:
        raise ValueError(f"--router_options sets up routers for {unknown}, which --residuals {residuals} "
                         "does not sweep; add them to --residuals or drop their options.")
    runs = {(residual, seed): full_depth_run(Path(runs_dir), residual, depth, seed, run_label)
            for seed in seeds for residual in residuals}  # every run found before any is swept
    out_dir = Path(out)
    curves = {}
    for (residual, seed), run in runs.items():
        settings = {"eval_sequences": eval_sequences, "eval_seed": eval_seed, "fit_batches": fit_batches,
                    "fit_lr": fit_lr, "router_options": router_options.get(residual)}
        curves[(residual, seed)] = cached_sweep(run, out_dir, settings, device, trust_checkpoint)
        print(json.dumps({"run": run.name, "settings": len({r["tau"] for r in curves[(residual, seed)]})}),
              flush=True)
    write_csv([{"residual": residual, "seed": seed, "run": runs[(residual, seed)].name, **row}
               for (residual, seed), rows in curves.items() for row in rows], out_dir / "tradeoff_tasks.csv")
    write_table(curves, out_dir / "tradeoff_tasks.md")
    plot(curves, out_dir / "tradeoff_tasks.png")
    print((out_dir / "tradeoff_tasks.md").read_text())
    return curves
