"""Tables and a figure of the runs `task_depth_probe.py --diagnose` cached under a folder (the
probe's last version: `git show 903e526:experiments/task_depth_probe.py`).

    python experiments/diagnosis_report.py RUNS_DIR [--figure docs/PNG] [--match SUBSTRING ...]

Prints, per run (grouped by residual, options and depth, seeds side by side): accuracy per level at
the end, the steps each level took to reach 90% (1 and 2 hops) and 50% (3 and 4 hops), and from the
diagnostics: the gradient norm reaching the first, middle and last sublayer over training, the
angle per sublayer at format and answer tokens, the share of tokens at the gate's bound, direction
survival over 4 sublayers, the readout's scale on right and wrong answers, and the price's share of
the loss.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def read_folder(run_dir: Path) -> dict | None:
    """A `study tasks` run folder as the probe's JSON: settings, accuracy history and final levels,
    diagnostics and gradients; None if it holds no stream diagnostics."""
    import yaml

    from nag_lightning.analysis.studies.tasks import accuracy_history

    version = run_dir / "version_0"
    lines = version / "stream_diagnostics.jsonl"
    if not lines.is_file():
        return None
    config = yaml.safe_load((version / "config.yaml").read_text())
    arch = config["model"]["arch"]
    history: dict[int, dict] = {}
    for row in accuracy_history(version / "metrics.csv"):
        level = "0" if row["name"] == "format" else row["name"].lstrip("k")
        history.setdefault(row["step"], {})[level] = row["accuracy"]
    steps = sorted(history)
    rows = [json.loads(line) for line in lines.read_text().splitlines()]
    return {"residual": arch["residual"], "residual_options": arch.get("residual_options") or {},
            "lr": config["model"]["lr"], "depth": arch["n_layers"], "seed": config["seed_everything"],
            "history": [{"step": step, "acc": history[step]} for step in steps],
            "levels": {k: {"acc": v} for k, v in history[steps[-1]].items()},
            "diagnostics": [r for r in rows if r["kind"] == "validation"],
            "gradients": [r for r in rows if r["kind"] == "gradients"]}


def label(run: dict) -> str:
    options = ", ".join(f"{k}={v}" for k, v in run.get("residual_options", {}).items())
    return f"{run['residual']}" + (f" ({options})" if options else "") + f" lr {run['lr']:g} L{run['depth']}"


def steps_to(run: dict, level: str, target: float) -> int | None:
    for row in run["history"]:
        if row["acc"].get(level, 0.0) >= target:
            return row["step"]
    return None


def mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def fmt(value, digits=1, scale=1.0):
    return "-" if value is None else f"{value * scale:.{digits}f}"


def accuracy_table(groups: dict[str, list[dict]]) -> str:
    lines = ["| run | seeds | 1 hop | 2 hops | 3 hops | 4 hops | mean 3+4 | steps to 90%: 1 hop | 2 hops "
             "| steps to 50%: 3 hops | 4 hops |", "|---" * 11 + "|"]
    for name, runs in groups.items():
        acc = {k: mean([r["levels"].get(k, {}).get("acc") for r in runs]) for k in ("1", "2", "3", "4")}
        hard = None if acc["3"] is None or acc["4"] is None else (acc["3"] + acc["4"]) / 2
        reach = [[steps_to(r, k, t) for r in runs] for k, t in (("1", .9), ("2", .9), ("3", .5), ("4", .5))]
        cells = [", ".join("-" if s is None else str(s) for s in seeds) for seeds in reach]
        lines.append(f"| {name} | {', '.join(str(r['seed']) for r in runs)} | "
                     + " | ".join(fmt(acc[k], 1, 100) for k in ("1", "2", "3", "4"))
                     + f" | {fmt(hard, 1, 100)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def gradient_table(groups: dict[str, list[dict]], steps=(100, 500, 1000, 2000, 3000)) -> str:
    lines = ["| run | step | grad norm per sublayer (seed-mean) | gate grad (mean over sublayers) "
             "| price / loss |", "|---|---|---|---|---|"]
    for name, runs in groups.items():
        for step in steps:
            rows = [next((g for g in r.get("gradients", []) if g["step"] == step), None) for r in runs]
            rows = [g for g in rows if g]
            if not rows:
                continue
            per = [statistics.fmean(g["sublayer"][i] for g in rows) for i in range(len(rows[0]["sublayer"]))]
            gate = mean([statistics.fmean(g["gate"]) for g in rows if "gate" in g])
            price = mean([g["aux"] / g["loss"] for g in rows if g["loss"]])
            lines.append(f"| {name} | {step} | {' '.join(f'{v:.3f}' for v in per)} | {fmt(gate, 4)} | "
                         f"{fmt(price, 3, 100)}% |")
    return "\n".join(lines)


def angle_table(groups: dict[str, list[dict]], steps=(500, 3000)) -> str:
    lines = ["| run | step | angle format (rad, per sublayer) | angle answers | at bound / near 0 (mean) "
             "| survive 4: format / answers | readout scale right / wrong |", "|---" * 7 + "|"]
    for name, runs in groups.items():
        for step in steps:
            diags = [next((d for d in r.get("diagnostics", []) if d["step"] == step), None) for r in runs]
            diags = [d for d in diags if d]
            if not diags:
                continue
            subs = len(diags[0]["sublayers"])
            af = [statistics.fmean(d["sublayers"][i]["angle_format"] for d in diags) for i in range(subs)]
            aa = [statistics.fmean(d["sublayers"][i]["angle_answer"] for d in diags) for i in range(subs)]
            bound = mean([statistics.fmean(s.get("near_bound", 0) for s in d["sublayers"]) for d in diags])
            zero = mean([statistics.fmean(s.get("near_zero", 0) for s in d["sublayers"]) for d in diags])
            has_gate = "near_bound" in diags[0]["sublayers"][0]
            s4f, s4a = (mean([statistics.fmean(s[key] for s in d["sublayers"] if key in s)
                              for d in diags if any(key in s for s in d["sublayers"])])
                        for key in ("survive4_format", "survive4_answer"))
            right = mean([d["readout"].get("scale_right_answer") for d in diags])
            wrong = mean([d["readout"].get("scale_wrong_answer") for d in diags])
            angles = f"{' '.join(f'{v:.2f}' for v in af)} | {' '.join(f'{v:.2f}' for v in aa)}"
            lines.append(f"| {name} | {step} | {angles} "
                         f"| {fmt(bound, 2) if has_gate else '-'} / {fmt(zero, 2) if has_gate else '-'} "
                         f"| {fmt(s4f, 2)} / {fmt(s4a, 2)} | {fmt(right, 2)} / {fmt(wrong, 2)} |")
    return "\n".join(lines)


def figure(groups: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4), sharey=True)
    for name, runs in groups.items():
        for ax, level in zip(axes, ("1", "2", "3", "4")):
            steps = [row["step"] for row in runs[0]["history"]]
            acc = [statistics.fmean(r["history"][i]["acc"].get(level, 0)
                                    for r in runs if i < len(r["history"])) for i in range(len(steps))]
            ax.plot(steps, [100 * a for a in acc], label=name)
            ax.set_title(f"{level} hop{'s' if level != '1' else ''}: accuracy (%), mean over seeds")
            ax.set_xlabel("step")
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs")
    parser.add_argument("--match", nargs="*", default=[], help="keep runs whose label holds one of these")
    parser.add_argument("--figure", default=None)
    parser.add_argument("--sections", nargs="*", default=["accuracy", "gradients", "angles"])
    parser.add_argument("--gradient_steps", nargs="*", type=int, default=[100, 500, 1000, 2000, 3000])
    parser.add_argument("--angle_steps", nargs="*", type=int, default=[500, 3000])
    args = parser.parse_args()
    groups: dict[str, list[dict]] = defaultdict(list)
    found = [json.loads(p.read_text()) for p in sorted(Path(args.runs).glob("*.json"))]
    found += [r for r in map(read_folder, sorted(p for p in Path(args.runs).iterdir() if p.is_dir())) if r]
    for run in found:
        name = label(run)
        if args.match and not any(m in name for m in args.match):
            continue
        groups[name].append(run)
    groups = dict(sorted(groups.items(), key=lambda kv: (kv[1][0]["depth"], kv[0])))
    for runs in groups.values():
        runs.sort(key=lambda r: r["seed"])
    sections = {"accuracy": accuracy_table,
                "gradients": lambda groups: gradient_table(groups, args.gradient_steps),
                "angles": lambda groups: angle_table(groups, args.angle_steps)}
    for section in args.sections:
        print(sections[section](groups) + "\n")
    if args.figure:
        figure(groups, Path(args.figure))


if __name__ == "__main__":
    main()
