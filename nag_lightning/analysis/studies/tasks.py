"""`nag-lightning study tasks`: residual strategies at several depths (and routers) on a task whose
every token has a known difficulty (`nag_lightning.tasks`).

Every run is `nag-lightning fit` on a task recipe (`recipes/tasks/*.yaml`) with only
`model.arch.n_layers`, `model.arch.residual`, the seed, the residual's own learning rate (`--lrs`)
and, with `--routers`, the router's options changed (`--extra` adds any `fit` option to every
run, e.g. the residual's options), trained and cached as every study's runs are
(`nag_lightning.analysis.studies.study`) under `{residual}-L{depth}-s{seed}[-{router}]`. Training
is the package's own: the LightningModule, its optimizer groups and schedule
(`nag_lightning.training.optim`), clipped by the recipe's `trainer.gradient_clip_val`.

With `--iso_flop`, every run spends the training FLOPs that the full-depth, unrouted model of its
config spends in the recipe's `trainer.max_steps` steps (a `FlopBudget` of that many tokens, the
package's exact count), so a routed run trains on more steps; the schedule is then
warmup-stable-decay, whose decay fills the end of each run's own budget, and `trainer.max_steps`
is raised to a ceiling (`ISO_FLOP_CEILING` times the recipe's) that the budget stops before.

Every validation logs accuracy per difficulty level (`val/difficulty/<level>/accuracy`); the study
reads that history back from each run's metrics.csv, so the step at which a level first reaches
`--reach` accuracy can be read. After training, each run's last checkpoint is evaluated by
difficulty (`nag_lightning.tasks.evaluation`) on `--eval_sequences` sequences from an evaluation
seed stream that neither training nor validation draws from; the evaluation is cached in the
run's folder as difficulty.json.

It writes, into `--out`:

    tasks.csv               one row per run and difficulty level: accuracy, loss, count, compute
                            (angle summed over sublayers, NAG's planned angle, sublayers executed,
                            skip rate) and the run's rank correlations
    tasks.md                per (residual, router, depth), mean over seeds: accuracy per level and
                            the Spearman correlation of compute with difficulty over answer tokens
                            (and of the angle over format tokens and answers)
    tasks_history.csv       one row per run, validation step and level: the validation accuracy
    tasks_steps.md          per (residual, router, depth): the first validation step at which each
                            level reached `--reach` accuracy, mean over the seeds that reached it
    tasks.png               accuracy against depth, one panel per residual (and router), a line per level
    tasks_compute.png       compute against difficulty at each depth, one panel per residual
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import yaml

from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.analysis.studies.depth import check_options
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
ISO_FLOP_CEILING = 10
"""An iso-FLOP run's `trainer.max_steps`, in multiples of the recipe's: its FLOP budget ends it first."""
ACCURACY = "val/difficulty/{}/accuracy"
PREDICTABLE = "spearman_angle_predictable"
"""The angle's rank correlation with difficulty over format tokens and answers alike (labels >= 0):
whether a token's turn tells the format it copies from the hops it follows."""


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
    fresh sequences of its task, and the rank correlations (cached in difficulty.json). A routed
    run's levels also hold `accuracy_every_token`: its accuracy with every token run through every
    sublayer (`every_token_runs`), what it learned apart from what its routing uses."""
    cached = run / "difficulty.json"
    result = json.loads(cached.read_text()) if cached.is_file() else None
    config = run / "version_0" / "config.yaml"
    routed = ((yaml.safe_load(config.read_text()) or {}).get("model", {}).get("arch", {})
              .get("router", "none") != "none")
    if result is not None and routed and "skip_rate_attn" not in result["levels"][0]:
        result = None  # scored before the skip rates per sublayer kind and role: score again
    if result is not None and PREDICTABLE not in result:
        result = None  # scored before the correlation over format tokens and answers: score again
    if result is not None and (not routed or "accuracy_every_token" in result["levels"][0]):
        return result
    from nag_lightning.tasks import build_task
    from nag_lightning.tasks.evaluation import evaluate_checkpoint, role_table, spearman, task_sequences

    task, options, seq_len = task_settings(config)
    ckpt = str(run / "version_0" / "checkpoints" / "last.ckpt")
    labelled = task_sequences(task, options, sequences, seq_len + 1, seed)

    def evaluated(every_token: bool):
        return evaluate_checkpoint(ckpt, labelled, trust_checkpoint=trust_checkpoint, every_token=every_token)

    if result is None:
        report = evaluated(False)
        result = {"levels": report.rows,
                  **{f"spearman_{measure}": spearman(report.tokens, measure) for measure in COMPUTE},
                  PREDICTABLE: spearman(report.tokens, "angle", answers_only=False)}
        roles = build_task(task, **options).roles(labelled)
        if roles:  # skip rates by what a token is in its episode: where the work of an answer runs
            n_sublayers = 2 * int(yaml.safe_load(config.read_text())["model"]["arch"]["n_layers"])
            result["roles"] = role_table(report.tokens, roles, n_sublayers)
    if routed:
        full = {row["name"]: row["accuracy"] for row in evaluated(True).rows}
        for row in result["levels"]:
            row["accuracy_every_token"] = full.get(row["name"])
    cached.write_text(json.dumps(result))
    return result


def recipe_setting(recipe: str, extra: list[str], dotted: str, default: object = None) -> object:
    """A setting of the runs: its last `--dotted=value` in `extra`, else the recipe's (a data
    setting under `init_args`), else `default`."""
    for arg in reversed(extra):
        if arg.startswith(f"--{dotted}="):
            return yaml.safe_load(arg.split("=", 1)[1])
    node = yaml.safe_load(Path(recipe).read_text()) or {}
    for key in dotted.split("."):
        if isinstance(node, dict) and "init_args" in node and key not in node:
            node = node["init_args"]
        node = node.get(key) if isinstance(node, dict) else None
    return default if node is None else node


def iso_flop_args(recipe: str, extra: list[str]) -> list[str]:
    """The `fit` options of an iso-FLOP run: a FLOP budget of the full-depth model's tokens in
    the recipe's steps, WSD, and a ceiling of steps the budget stops before."""
    steps = recipe_setting(recipe, extra, "trainer.max_steps")
    batch = recipe_setting(recipe, extra, "data.batch_size")
    seq_len = recipe_setting(recipe, extra, "model.arch.seq_len")
    if not all(isinstance(v, int) and v > 0 for v in (steps, batch, seq_len)):
        raise ValueError(f"--iso_flop needs the recipe's trainer.max_steps, data.batch_size and "
                         f"model.arch.seq_len as positive numbers; got {steps}, {batch} and {seq_len}.")
    return ["--trainer.callbacks+=nag_lightning.callbacks.FlopBudget",
            f"--trainer.callbacks.reference_tokens={steps * batch * seq_len}",
            f"--trainer.max_steps={ISO_FLOP_CEILING * steps}", "--model.schedule=wsd"]


def accuracy_history(metrics_csv: Path) -> list[dict]:
    """Every validation's accuracy per difficulty level, from a run's metrics.csv: rows of step
    (the training steps done: a validation after n steps is logged at step n - 1), level name and
    accuracy, in step order."""
    from nag_lightning.training.metrics import metric_columns

    history = []
    for key, points in metric_columns(metrics_csv).items():
        if key.startswith("val/difficulty/") and key.endswith("/accuracy"):
            level = key[len("val/difficulty/"):-len("/accuracy")]
            history += [{"step": step + 1, "name": level, "accuracy": value} for step, value in points]
    return sorted(history, key=lambda r: (r["step"], r["name"]))


def steps_to_reach(history: list[dict], reach: float) -> dict[str, int | None]:
    """Per level, the first validation step whose accuracy is at least `reach` (None: never)."""
    first: dict[str, int | None] = {}
    for row in history:
        first.setdefault(row["name"], None)
        if first[row["name"]] is None and row["accuracy"] >= reach:
            first[row["name"]] = row["step"]
    return first


def write_steps(points: list[dict], reach: float, path: Path) -> None:
    """Per (residual, router, depth), the mean over seeds of the step each level first reached
    `reach`, and how many seeds reached it; written as a markdown table."""
    groups: dict[tuple, list[dict]] = {}
    for point in points:
        groups.setdefault((point["residual"], point["router"], point["depth"]), []).append(point)
    names = sorted({n for p in points for n in p["steps_to_reach"]}, key=_level_order)
    cells = []
    for (residual, router, depth), runs in groups.items():
        row = [residual, router or "-", str(depth)]
        for name in names:
            reached = [r["steps_to_reach"].get(name) for r in runs]
            kept = [s for s in reached if s is not None]
            mean = f"{statistics.fmean(kept):.0f}" if kept else "-"
            row.append(f"{mean} ({len(kept)}/{len(runs)})")
        cells.append(row)
    note = (f"\nThe first validation step at which a level's accuracy reached {reach:g}: mean over the seeds "
            "that reached it (seeds that reached it / seeds); -: none did.\n")
    path.write_text(markdown_table(["residual", "router", "blocks", *names], cells) + note)


def _level_order(name: str) -> tuple[int, str]:
    return (0, name) if not (name[:1] == "k" and name[1:].isdigit()) else (1, f"{int(name[1:]):06d}")


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
        entry[PREDICTABLE] = _mean(list({r["seed"]: r[PREDICTABLE] for r in runs}.values()))
        summary.append(entry)
    head = ["residual", "router", "blocks", *(f"acc {n}" for n in names),
            *(f"rho {m}" for m in COMPUTE), "rho angle, format and answers", "seeds"]
    cells = [[e["residual"], e["router"] or "-", str(e["depth"]),
              *(_cell(e[n]) for n in names), *(_cell(e[f"spearman_{m}"]) for m in COMPUTE),
              _cell(e[PREDICTABLE]), str(e["seeds"])]
             for e in summary]
    note = ("\nacc: exact-match accuracy per difficulty level (format tokens and answers of k steps), mean "
            "over seeds. rho: Spearman correlation between a token's compute and its difficulty over the "
            "answer tokens (labels >= 1): angle summed over sublayers, NAG's planned angle, sublayers "
            "executed; the angle's also over format tokens and answers (labels >= 0); empty where the "
            "measure is constant or absent.\n")
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
    iso_flop: bool = False,
    reach: float = 0.9,
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
        iso_flop: every run spends the training FLOPs of the full-depth, unrouted model in the
            recipe's trainer.max_steps steps (a FlopBudget), under the WSD schedule, so a routed
            run trains on more steps.
        reach: the accuracy whose first validation step per level tasks_steps.md reports.
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
    if not 0 < reach <= 1:
        raise ValueError(f"--reach is an accuracy in (0, 1]; got {reach}.")
    if eval_sequences < 1:
        raise ValueError(f"--eval_sequences must be at least 1; got {eval_sequences}.")
    if any(not label or "/" in label for label in routers):
        raise ValueError(f"Each --routers label names a run folder: give short names without '/'; got "
                         f"{list(routers)}.")
    out_dir = Path(out)
    budget = iso_flop_args(recipe, extra) if iso_flop else []
    rows, history, points = [], [], []
    for seed, depth, residual, router in study_points(depths, seeds, residuals, routers):
        name = run_name(residual, depth, seed) + (f"-{router}" if router else "")
        args = ["--config", recipe, f"--model.arch.n_layers={depth}", f"--model.arch.residual={residual}",
                f"--seed_everything={seed}", *extra, *routers.get(router, []), *budget,
                *([f"--model.lr={lrs[residual]}"] if residual in lrs else [])]
        trained = fit_run(out_dir, name, args)
        result = evaluate_run(out_dir / name, eval_sequences, eval_seed, trust_checkpoint)
        point = {"residual": residual, "router": router, "depth": depth, "seed": seed,
                 "lr": lrs.get(residual), "val_bpb": trained["val_bpb"], "steps": trained["step"] + 1,
                 **{k: v for k, v in result.items() if k != "levels"}}
        rows += [{**point, **level} for level in result["levels"]]
        curve = accuracy_history(out_dir / name / "version_0" / "metrics.csv")
        history += [{"residual": residual, "router": router, "depth": depth, "seed": seed, **row}
                    for row in curve]
        points.append({"residual": residual, "router": router, "depth": depth,
                       "steps_to_reach": steps_to_reach(curve, reach)})
        accuracy = {r["name"]: r["accuracy"] for r in result["levels"]}
        print(json.dumps({**point, "accuracy": accuracy}), flush=True)
    write_csv(rows, out_dir / "tasks.csv")
    write_csv(history, out_dir / "tasks_history.csv")
    write_steps(points, reach, out_dir / "tasks_steps.md")
    summary = summarise(rows, out_dir)
    plot_accuracy(summary, out_dir / "tasks.png")
    plot_compute(rows, out_dir / "tasks_compute.png")
    print((out_dir / "tasks.md").read_text())
    return rows
