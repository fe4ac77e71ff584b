"""`nag-lightning study tasks`: residual strategies at several depths (and routers) on a task whose
every token has a known difficulty (`nag_lightning.tasks`).

Every run is `nag-lightning fit` on a task recipe (`recipes/tasks/*.yaml`) with only
`model.arch.n_layers`, `model.arch.residual`, the seed, the residual's own learning rate (`--lrs`)
and, with `--routers`, the router's options changed, trained and cached as every study's runs are
(`nag_lightning.analysis.studies.study`) under `{residual}-L{depth}-s{seed}[-{router}]`. After training,
each run's last checkpoint is evaluated by difficulty (`nag_lightning.tasks.evaluation`) on
`--eval_sequences` sequences from an evaluation seed stream that neither training nor validation
draws from; the evaluation is cached in the run's folder as difficulty.json.

It writes, into `--out`:

    tasks.csv               one row per run and difficulty level: accuracy, loss, count, compute
                            (angle summed over sublayers, NAG's planned angle, sublayers executed,
                            skip rate) and the run's rank correlations
    tasks.md                per (residual, router, depth), mean over seeds: accuracy per level and
                            the Spearman correlation of compute with difficulty over answer tokens
    tasks.png               accuracy against depth, one panel per residual (and router), a line per level
    tasks_compute.png       compute against difficulty at each depth, one panel per residual
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import yaml

from nag_lightning.analysis.studies.depth import check_options
from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.analysis.studies.study import (
    DEFAULT_RESIDUALS,
    find_recipe,
    fit_run,
    markdown_table,
    run_name,
    write_csv,
)

COMPUTE = ("angle", "planned", "executed")
"""The per-token compute measures correlated with difficulty (`TokenScores` fields)."""


def task_settings(config: Path) -> tuple[str, dict, int]:
    """The task, its options and the sequence length of a finished run, from the config.yaml its
    `fit` wrote; one sentence when the run did not train on task data."""
    saved = yaml.safe_load(config.read_text()) or {}
    data = saved.get("data") or {}
    init = data.get("init_args") or {}
    if not str(data.get("class_path", "")).endswith("TaskDataModule") or init.get("file") is not None:
        raise ValueError(f"{config} is not a run on a generated task; give study tasks a recipe whose data "
                         "is nag_lightning.tasks.datamodule.TaskDataModule with a task (see recipes/tasks/).")
    return init.get("task", "hops"), init.get("task_options") or {}, int(saved["model"]["arch"]["seq_len"])


def evaluate_run(run: Path, sequences: int, seed: int, trust_checkpoint: bool) -> dict:
    """Accuracy, loss and compute per level of a finished run's last checkpoint, on `sequences`
    fresh sequences of its task, and the rank correlations (cached in difficulty.json)."""
    cached = run / "difficulty.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    from nag_lightning.tasks.evaluation import evaluate_checkpoint, spearman, task_sequences

    task, options, seq_len = task_settings(run / "version_0" / "config.yaml")
    report = evaluate_checkpoint(str(run / "version_0" / "checkpoints" / "last.ckpt"),
                                 task_sequences(task, options, sequences, seq_len + 1, seed),
                                 trust_checkpoint=trust_checkpoint)
    result = {"levels": report.rows,
              **{f"spearman_{measure}": spearman(report.tokens, measure) for measure in COMPUTE}}
    cached.write_text(json.dumps(result))
    return result


def study_points(depths: list[int], seeds: list[int], residuals: list[str],
                 routers: dict[str, list[str]]):
    """(seed, depth, residual, router label) of every run, seed-major: a partial study already
    has one seed of every point."""
    for seed in seeds:
        for depth in depths:
            for residual in residuals:
                for router in routers or [None]:
                    yield seed, depth, residual, router


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(kept) if kept else None


def summarise(rows: list[dict], out: Path) -> list[dict]:
    """Per (residual, router, depth): mean over seeds of each level's accuracy and of each rank
    correlation; written to tasks.md."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["residual"], row["router"], row["depth"]), []).append(row)
    names = [name for level, name in sorted({(r["level"], r["name"]) for r in rows}) if level >= 0]
    summary = []
    panels = dict.fromkeys((r["residual"], r["router"]) for r in rows)  # in the order the study ran them
    order = {key: index for index, key in enumerate(panels)}
    for (residual, router, depth), runs in sorted(groups.items(), key=lambda g: (order[g[0][:2]], g[0][2])):
        entry = {"residual": residual, "router": router, "depth": depth,
                 "seeds": len({r["seed"] for r in runs})}
        for name in names:
            entry[name] = _mean([r["accuracy"] for r in runs if r["name"] == name])
        for measure in COMPUTE:
            per_seed = {r["seed"]: r[f"spearman_{measure}"] for r in runs}  # one value per run
            entry[f"spearman_{measure}"] = _mean(list(per_seed.values()))
        summary.append(entry)
    head = ["residual", "router", "blocks", *(f"acc {n}" for n in names),
            *(f"rho {m}" for m in COMPUTE), "seeds"]
    cells = [[e["residual"], e["router"] or "-", str(e["depth"]),
              *(_cell(e[n]) for n in names), *(_cell(e[f"spearman_{m}"]) for m in COMPUTE), str(e["seeds"])]
             for e in summary]
    note = ("\nacc: exact-match accuracy per difficulty level (format tokens and answers of k steps), mean "
            "over seeds. rho: Spearman correlation between a token's compute and its difficulty over the "
            "answer tokens (labels >= 1): angle summed over sublayers, NAG's planned angle, sublayers "
            "executed; empty where the measure is constant or absent.\n")
    (out / "tasks.md").write_text(markdown_table(head, cells) + note)
    return summary


def _cell(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def plot_accuracy(summary: list[dict], path: Path) -> None:
    """Accuracy against depth, a panel per (residual, router), a line per difficulty level."""
    panels = list(dict.fromkeys((e["residual"], e["router"]) for e in summary))
    levels = [k for k in summary[0] if k == "format" or (k[0] == "k" and k[1:].isdigit())]
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), squeeze=False, sharey=True)
    colors = plt.get_cmap("viridis")
    for ax, (residual, router) in zip(axes[0], panels):
        points = [e for e in summary if (e["residual"], e["router"]) == (residual, router)]
        for index, level in enumerate(levels):
            style = (dict(color="black", ls="--") if level == "format"
                     else dict(color=colors(index / len(levels)), ls="-"))
            ax.plot([e["depth"] for e in points], [e[level] for e in points], marker="o", label=level,
                    **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks([e["depth"] for e in points], [str(e["depth"]) for e in points])
        ax.set(xlabel="blocks", title=residual if router is None else f"{residual}, {router}",
               ylim=(-0.02, 1.02))
    axes[0][0].set_ylabel("exact-match accuracy (mean over seeds)")
    axes[0][-1].legend(fontsize=7, title="difficulty")
    save(fig, path)


def plot_compute(rows: list[dict], path: Path) -> None:
    """Mean angle summed over sublayers (and executed sublayers, when a router skips) against
    difficulty level, a panel per (residual, router), a line per depth (mean over seeds)."""
    panels = list(dict.fromkeys((r["residual"], r["router"]) for r in rows))
    routed = any(r["skip_rate"] > 0 for r in rows)
    plt = pyplot()
    fig, axes = plt.subplots(1 + routed, len(panels), figsize=(4.5 * len(panels), 3.8 * (1 + routed)),
                             squeeze=False)
    for column, (residual, router) in enumerate(panels):
        mine = [r for r in rows if (r["residual"], r["router"]) == (residual, router)]
        for depth in sorted({r["depth"] for r in mine}):
            levels = sorted({r["level"] for r in mine if r["depth"] == depth and r["level"] >= 0})
            for row_index, key in enumerate(["angle", "executed"][:1 + routed]):
                means = [_mean([r[key] for r in mine if r["depth"] == depth and r["level"] == k])
                         for k in levels]
                axes[row_index][column].plot(levels, means, "o-", label=f"{depth} blocks")
                axes[row_index][column].set_xticks(levels)
        title = residual if router is None else f"{residual}, {router}"
        axes[0][column].set(title=title, xlabel="difficulty (0: format)",
                            ylabel="angle summed over sublayers (rad)")
        if routed:
            axes[1][column].set(xlabel="difficulty (0: format)", ylabel="sublayers executed")
        axes[0][column].legend(fontsize=7)
    save(fig, path)


def tasks_study(
    recipe: str = "recipes/tasks/hops.yaml",
    out: str = "runs/study/tasks",
    depths: list[int] = [2, 4, 8],  # noqa: B006 - jsonargparse reads the default as data
    seeds: list[int] = [1],  # noqa: B006
    residuals: list[str] = list(DEFAULT_RESIDUALS),  # noqa: B006
    lrs: dict[str, float] = {},  # noqa: B006
    routers: dict[str, list[str]] = {},  # noqa: B006
    extra: list[str] = [],  # noqa: B006
    eval_sequences: int = 512,
    eval_seed: int = 1000,
    trust_checkpoint: bool = False,
) -> list[dict]:
    """Train residual strategies at each depth, seed (and router) on a task, evaluate every run by
    difficulty on fresh sequences, then write a CSV, a table and figures.

    Args:
        recipe: the fit recipe every run shares; its data must be a generated task.
        out: folder for the runs, tables and figures.
        depths: numbers of blocks to train.
        seeds: seeds per point; at least 2 before drawing a conclusion.
        residuals: residual strategies to compare, any registered ones.
        lrs: each strategy's own learning rate, e.g. {prenorm: 6e-3, nag: 1.2e-2}; one left out
            keeps the recipe's.
        routers: router settings to train under, each a label and its `fit` options, e.g.
            {topk25: ["--model.arch.router=topk", "--model.arch.router_options={capacity: 0.75}"]};
            empty: no router.
        extra: further `fit` arguments passed to every run, e.g. ["--trainer.max_steps=500"].
        eval_sequences: sequences each run is evaluated on after training.
        eval_seed: seed of the evaluation sequences (drawn from a stream training never uses).
        trust_checkpoint: let a run's checkpoint name a residual or router by a class path outside
            the registered plugins; only for run folders whose origin you trust.
    """
    recipe = find_recipe(recipe)
    check_options(residuals, {}, {})
    unknown = sorted(set(lrs) - set(residuals))
    if unknown:
        raise ValueError(f"--lrs gives a learning rate for {unknown}, which --residuals {residuals} does not "
                         "run; add them to --residuals or drop their learning rates.")
    if any(lr <= 0 for lr in lrs.values()):
        raise ValueError(f"Every learning rate in --lrs must be positive; got {lrs}.")
    if eval_sequences < 1:
        raise ValueError(f"--eval_sequences must be at least 1; got {eval_sequences}.")
    if any(not label or "/" in label for label in routers):
        raise ValueError(f"Each --routers label names a run folder: give short names without '/'; got "
                         f"{list(routers)}.")
    out_dir = Path(out)
    rows = []
    for seed, depth, residual, router in study_points(depths, seeds, residuals, routers):
        name = run_name(residual, depth, seed) + (f"-{router}" if router else "")
        args = ["--config", recipe, f"--model.arch.n_layers={depth}", f"--model.arch.residual={residual}",
                f"--seed_everything={seed}", *extra, *routers.get(router, []),
                *([f"--model.lr={lrs[residual]}"] if residual in lrs else [])]
        trained = fit_run(out_dir, name, args)
        result = evaluate_run(out_dir / name, eval_sequences, eval_seed, trust_checkpoint)
        point = {"residual": residual, "router": router, "depth": depth, "seed": seed,
                 "lr": lrs.get(residual), "val_bpb": trained["val_bpb"],
                 **{k: v for k, v in result.items() if k != "levels"}}
        rows += [{**point, **level} for level in result["levels"]]
        accuracy = {r["name"]: r["accuracy"] for r in result["levels"]}
        print(json.dumps({**point, "accuracy": accuracy}), flush=True)
    write_csv(rows, out_dir / "tasks.csv")
    summary = summarise(rows, out_dir)
    plot_accuracy(summary, out_dir / "tasks.png")
    plot_compute(rows, out_dir / "tasks_compute.png")
    print((out_dir / "tasks.md").read_text())
    return rows
