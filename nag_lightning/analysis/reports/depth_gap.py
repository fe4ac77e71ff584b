"""`nag-lightning study gap`: a residual's gap to the better of its baselines against depth, read
from finished `study tasks` runs, each residual at its own best learning rate per depth.

A learning-rate sweep is several `study tasks` folders (one per rate); this reads the runs
themselves, not the folders' tables, so runs of any folder, seed or rate join: every folder under
`--runs` holding a difficulty.json (the run's evaluation on fresh sequences) and its
version_0/config.yaml (what it trained: residual, blocks, learning rate, seed, task). Unrouted runs
only; every run must have trained on the same task with the same options and steps. A run trained
with residual_options is a variant, named by the residual and its options (`nag[theta_max=0.25]`):
it never joins the default's runs, and is shown only when `--also` names it.

Per (residual, blocks, learning rate) the accuracy of each level is the mean over seeds; the score
is the mean over `--levels` (default: every level of 2 hops and more, where composition is needed).
Each residual's rate at a depth is the one with the best score, among rates with the most seeds
(a rate tried on one seed does not win over one confirmed on two by a lucky draw). The gap is the
residual's score minus the better baseline's at that depth.

It writes, into `--out`:

    gap.csv        one row per (residual, blocks, learning rate): seeds, score, accuracy per level,
                   and whether it is the residual's chosen rate at that depth
    gap.md         the chosen rates: score per residual and depth, the gap; every rate tried; each
                   level at the chosen rates; the first validation step each level reached --reach
    gap.png        left: the score against depth, a line per residual; right: the gap against depth,
                   on the score and on each level
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import yaml

from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.analysis.studies.study import markdown_table, write_csv
from nag_lightning.analysis.studies.tasks import accuracy_history, steps_to_reach


def find_runs(roots: list[str]) -> list[Path]:
    """Every finished, evaluated run folder under `roots` (itself or below)."""
    runs = set()
    for root in map(Path, roots):
        if not root.is_dir():
            raise ValueError(f"--runs names {root}, which is not a folder; give folders of `study tasks` "
                             "runs.")
        runs.update(path.parent for path in root.rglob("difficulty.json")
                    if (path.parent / "version_0" / "config.yaml").is_file())
    return sorted(runs)


def variant_name(residual: str, options: dict | None) -> str:
    """A residual's name with its options, e.g. nag[theta_max=0.25]; the bare name without any."""
    if not options:
        return residual
    return residual + "[" + ", ".join(f"{key}={options[key]}" for key in sorted(options)) + "]"


def read_run(run: Path) -> dict | None:
    """A run's settings, accuracy per level and validation history; None for a routed run."""
    config = yaml.safe_load((run / "version_0" / "config.yaml").read_text()) or {}
    model = config.get("model") or {}
    arch = model.get("arch") or {}
    if arch.get("router", "none") not in ("none", None):
        return None
    init = (config.get("data") or {}).get("init_args") or {}
    levels = json.loads((run / "difficulty.json").read_text())["levels"]
    return {
        "run": run, "residual": variant_name(str(arch["residual"]), arch.get("residual_options")),
        "depth": int(arch["n_layers"]),
        "lr": float(model["lr"]), "seed": config.get("seed_everything"),
        "task": json.dumps([init.get("task"), init.get("task_options"), (config.get("trainer") or {})
                            .get("max_steps")], sort_keys=True),
        "levels": {row["name"]: (row["level"], row["accuracy"]) for row in levels if row["level"] >= 0},
        "history": accuracy_history(run / "version_0" / "metrics.csv"),
    }


def scored_levels(runs: list[dict], levels: list[str] | None) -> list[str]:
    """The levels a score averages: `levels`, else every level of 2 hops and more."""
    known = {name: level for run in runs for name, (level, _) in run["levels"].items()}
    if levels is None:
        chosen = sorted((name for name, level in known.items() if level >= 2), key=known.get)
    else:
        missing = sorted(set(levels) - set(known))
        if missing:
            raise ValueError(f"--levels names {missing}, which no run has; its levels are {sorted(known)}.")
        chosen = list(levels)
    if not chosen:
        raise ValueError(f"The runs have no level of 2 hops or more ({sorted(known)}); name the levels to "
                         "score with --levels.")
    return chosen


def group(runs: list[dict], names: list[str]) -> list[dict]:
    """Per (residual, depth, lr): seeds, mean accuracy per level, the score over `names`, and the
    mean first step each level reached each reach (filled by `depth_gap`)."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["residual"], run["depth"], run["lr"]), []).append(run)
    cells = []
    order = {name: level for run in runs for name, (level, _) in run["levels"].items()}
    all_names = sorted(order, key=order.get)
    for (residual, depth, lr), members in sorted(groups.items()):
        accuracy = {name: statistics.fmean(m["levels"][name][1] for m in members if name in m["levels"])
                    for name in all_names}
        cells.append({"residual": residual, "depth": depth, "lr": lr,
                      "seeds": len({m["seed"] for m in members}),
                      "score": statistics.fmean(accuracy[n] for n in names), **accuracy,
                      "members": members})
    return cells


def choose(cells: list[dict]) -> dict[tuple, dict]:
    """Per (residual, depth), the rate with the best score among those with the most seeds."""
    best: dict[tuple, dict] = {}
    for cell in cells:
        key = (cell["residual"], cell["depth"])
        held = best.get(key)
        if held is None or (cell["seeds"], cell["score"]) > (held["seeds"], held["score"]):
            best[key] = cell
    return best


def depth_gap(
    runs: list[str],
    out: str = "runs/study/gap",
    residual: str = "nag",
    baselines: list[str] = ["prenorm", "periln"],  # noqa: B006 - jsonargparse reads the default as data
    levels: list[str] | None = None,
    reach: float = 0.5,
    also: list[str] = [],  # noqa: B006 - as baselines
) -> list[dict]:
    """Tabulate and draw a residual's gap to the better baseline against depth from finished task runs.

    Args:
        runs: folders holding `study tasks` runs (searched below), e.g. one folder per learning rate.
        out: folder for gap.csv, gap.md and gap.png.
        residual: the strategy whose gap is measured.
        baselines: the strategies it is measured against; at each depth, the better one's score.
        levels: the difficulty levels the score averages (e.g. [k4, k5]); None: 2 hops and more.
        reach: the accuracy whose first validation step per level the tables report.
        also: further strategies or variants (e.g. "nag[theta_max=0.25]") shown in the tables and the
            left panel at their best rates; they take no part in the gap.
    """
    if not 0 < reach <= 1:
        raise ValueError(f"--reach is an accuracy in (0, 1]; got {reach}.")
    found = [run for run in map(read_run, find_runs(runs)) if run is not None]
    shown = {residual, *baselines, *also}
    left_out = sorted({run["residual"] for run in found} - shown)
    if left_out:
        print(f"Left out: runs of {left_out}; name them in --also to show them.")
    found = [run for run in found if run["residual"] in shown]
    if not found:
        raise ValueError(f"No finished, evaluated unrouted run of {residual} or {baselines} under {runs}; "
                         "train them with `nag-lightning study tasks` first.")
    tasks = {run["task"] for run in found}
    if len(tasks) > 1:
        raise ValueError(f"The runs trained on different tasks or step budgets ({sorted(tasks)}); give "
                         "--runs folders of one task.")
    names = scored_levels(found, levels)
    cells = group(found, names)
    chosen = choose(cells)
    for cell in cells:
        cell["chosen"] = chosen[(cell["residual"], cell["depth"])] is cell
        reached = [steps_to_reach(m["history"], reach) for m in cell["members"]]
        cell["steps"] = {n: [r.get(n) for r in reached] for n in cell if n in found[0]["levels"]}
    depths = sorted({c["depth"] for c in cells})
    order = [r for r in (residual, *baselines, *also) if any(c["residual"] == r for c in cells)]
    gaps = gap_rows(chosen, depths, residual, baselines, ["score", *names])
    out_dir = Path(out)
    write_csv([{k: v for k, v in c.items() if k not in ("members", "steps")} for c in cells],
              out_dir / "gap.csv")
    (out_dir / "gap.md").write_text(report(cells, chosen, gaps, depths, order, residual, names, reach))
    plot_gap(chosen, gaps, depths, order, residual, names, out_dir / "gap.png")
    print((out_dir / "gap.md").read_text())
    return gaps


def gap_rows(chosen: dict, depths: list[int], residual: str, baselines: list[str],
             keys: list[str]) -> list[dict]:
    """Per depth with the residual and a baseline: the residual's value of each key minus the
    better baseline's, at each one's chosen rate."""
    rows = []
    for depth in depths:
        mine = chosen.get((residual, depth))
        theirs = [chosen[(b, depth)] for b in baselines if (b, depth) in chosen]
        if mine is None or not theirs:
            continue
        rows.append({"depth": depth, **{k: mine[k] - max(t[k] for t in theirs) for k in keys},
                     "better": max(theirs, key=lambda t: t["score"])["residual"]})
    return rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def report(cells: list[dict], chosen: dict, gaps: list[dict], depths: list[int], order: list[str],
           residual: str, names: list[str], reach: float) -> str:
    """gap.md: the chosen rates and the gap, every rate tried, each level, the steps to `reach`."""
    by_depth = {g["depth"]: g for g in gaps}
    head = ["blocks", *order, f"{residual} minus the better baseline"]
    rows = []
    for depth in depths:
        row = [str(depth)]
        for name in order:
            cell = chosen.get((name, depth))
            row.append("-" if cell is None else f"{_pct(cell['score'])} ({cell['lr']:g}, {cell['seeds']})")
        gap = by_depth.get(depth)
        row.append("-" if gap is None else f"{100 * gap['score']:+.1f}")
        rows.append(row)
    text = [f"Mean accuracy (%) over {', '.join(names)}, mean over seeds, each residual at its best rate "
            "(rate, seeds):\n\n", markdown_table(head, rows)]
    tried = [[c["residual"], str(c["depth"]), f"{c['lr']:g}", str(c["seeds"]), _pct(c["score"]),
              "yes" if c["chosen"] else ""] for c in sorted(cells, key=lambda c: (order.index(c["residual"]),
                                                                                   c["depth"], c["lr"]))]
    tried_head = ["residual", "blocks", "lr", "seeds", "score", "chosen"]
    text += ["\nEvery rate tried:\n\n", markdown_table(tried_head, tried)]
    levels = [n for n in cells[0] if n in cells[0]["steps"]]
    per_level = [[c["residual"], str(c["depth"]), *(_pct(c[n]) for n in levels)]
                 for c in sorted(chosen.values(), key=lambda c: (order.index(c["residual"]), c["depth"]))]
    text += ["\nAccuracy (%) per level at the chosen rates:\n\n",
             markdown_table(["residual", "blocks", *levels], per_level)]
    steps = []
    for c in sorted(chosen.values(), key=lambda c: (order.index(c["residual"]), c["depth"])):
        row = [c["residual"], str(c["depth"])]
        for n in levels:
            kept = [s for s in c["steps"][n] if s is not None]
            row.append(f"{statistics.fmean(kept):.0f} ({len(kept)}/{len(c['steps'][n])})" if kept else "-")
        steps.append(row)
    text += [f"\nFirst validation step at which a level reached {reach:g} accuracy, mean over the seeds "
             "that reached it (seeds that did / seeds; -: none), at the chosen rates:\n\n",
             markdown_table(["residual", "blocks", *levels], steps)]
    return "".join(text)


def plot_gap(chosen: dict, gaps: list[dict], depths: list[int], order: list[str], residual: str,
             names: list[str], path: Path) -> None:
    """Score against depth per residual; the gap against depth, on the score and on each level."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in order:
        points = [(d, chosen[(name, d)]["score"]) for d in depths if (name, d) in chosen]
        left.plot(*zip(*points), marker="o", label=name)
    colors = plt.get_cmap("viridis")
    for index, name in enumerate(names):
        right.plot([g["depth"] for g in gaps], [g[name] for g in gaps], marker=".", lw=1,
                   color=colors(index / max(len(names), 1)), label=name)
    right.plot([g["depth"] for g in gaps], [g["score"] for g in gaps], marker="o", lw=2.5, color="black",
               label="mean")
    right.axhline(0, color="grey", lw=0.8)
    for ax in (left, right):
        ax.set_xlim(min(depths) / 1.3, max(depths) * 1.3)  # also where a panel has no point yet
        ax.set_xscale("log", base=2)
        ax.set_xticks(depths, [str(d) for d in depths])
        ax.set_xlabel("blocks")
        ax.legend(fontsize=7)
    left.set(ylabel=f"accuracy over {', '.join(names)}", ylim=(-0.02, 1.02), title="each at its best rate")
    right.set(ylabel="accuracy difference", title=f"{residual} minus the better baseline")
    save(fig, path)
