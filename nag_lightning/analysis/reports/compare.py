"""`nag-lightning compare`: finished runs side by side at the training compute they spent.

For each run directory (a CSVLogger version folder with `metrics.csv`, or any folder above such
folders) it reads what `FlopAccounting` logged (`flops/total`, `flops/tokens`, ...) and the
validation bits per byte, and writes, into `--out`:

    compare.csv   compare.md   one row per run: tokens seen, training FLOPs, training seconds,
                               final val bits per byte
    compare.png   val bits per byte against training FLOPs and, beside it, against training
                  wall-clock seconds, one line per run: does the routed run get there sooner?

A run whose metrics lack the FLOP columns falls back to the totals kept in its last checkpoint; a
run with neither (trained without `FlopAccounting`) still gets its row, with '-' for tokens and
FLOPs, and no curve.
The training FLOPs of a validation point are interpolated between the logged totals around it
(the step cost of a run is close to constant, so this is exact to a fraction of one step), and so
are its training seconds (`time/train_seconds`, validation left out). Seconds compare runs only
where they shared a machine and its load; a run logged before the seconds were kept gets '-'.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.training.metrics import metric_columns

COLUMNS = ("run", "residual", "router", "steps", "tokens", "training_flops", "train_seconds",
           "executed_fraction", "executed_params_per_token", "final_val_bpb")


@dataclass
class RunSummary:
    """One finished run, as the comparison table shows it."""

    run: str
    residual: str
    router: str
    steps: int
    tokens: int | None  # None: the run has no FLOP totals
    training_flops: float  # nan: the run has no FLOP totals
    train_seconds: float  # wall-clock seconds of training (validation left out); nan: not logged
    executed_fraction: float
    executed_params_per_token: float
    final_val_bpb: float
    curve: list[tuple[float, float]] = field(default_factory=list)  # (training FLOPs, val bpb)
    time_curve: list[tuple[float, float]] = field(default_factory=list)  # (training seconds, val bpb)

    def row(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in COLUMNS}

    @property
    def has_flops(self) -> bool:
        return self.tokens is not None


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Every folder holding a metrics.csv at or below `paths`, in order, without repeats."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise FileNotFoundError(f"The run directory {path} does not exist; give a folder a run wrote.")
        hits = [path] if (path / "metrics.csv").is_file() else sorted(
            p.parent for p in path.rglob("metrics.csv"))
        if not hits:
            raise FileNotFoundError(
                f"No metrics.csv under {path}; give the folder of a run logged with CSVLogger "
                "(e.g. runs/isoflop/nag/version_0) or a folder above such runs."
            )
        found += [h for h in hits if h not in found]
    return found


def _checkpoint_totals(run_dir: Path) -> dict[str, float]:
    """FlopAccounting's totals from the run's last checkpoint, if there is one."""
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        return {}
    from nag_lightning.checkpoints.reader import read_saved

    state = read_saved(ckpt).raw.get("callbacks", {})
    accounting = state.get("FlopAccounting")
    if not accounting:
        return {}
    totals = _flop_totals(accounting, ckpt)
    kept = {"flops/total": totals["training_flops"], "flops/tokens": totals["tokens"],
            "steps": totals["steps"]}
    if "train_seconds" in accounting:
        kept["time/train_seconds"] = totals["train_seconds"]
    return kept


def _flop_totals(accounting: object, ckpt: Path) -> dict[str, float]:
    """FlopAccounting's saved totals as numbers; one sentence if they are damaged."""
    totals = {}
    for key, default in (("forward_flops", None), ("tokens", None), ("steps", 0), ("training_flops", 0.0),
                         ("train_seconds", 0.0)):
        value = accounting.get(key, default) if isinstance(accounting, dict) else None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
            raise ValueError(
                f"The FLOP totals in {ckpt} are damaged (FlopAccounting's {key} is {value!r}, not a "
                "count); restore the checkpoint, or leave the run out."
            )
        totals[key] = float(value)
    # a checkpoint written before routers counted their own backward holds 3 x forward
    totals["training_flops"] = totals["training_flops"] or 3.0 * totals["forward_flops"]
    return totals


def _hparams(run_dir: Path) -> dict:
    path = run_dir / "hparams.yaml"
    if not path.is_file():
        return {}
    import yaml

    try:
        settings = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError:
        return {}
    if not isinstance(settings, dict):
        raise ValueError(
            f"{path} holds a {type(settings).__name__}, not the mapping of settings a run writes; "
            "restore it, or remove it to compare the run without its residual and router."
        )
    return settings


def _label(run_dir: Path, runs: list[Path]) -> str:
    """The run's name: its logger name (the folder above version_N), with the version if needed."""
    name = run_dir.parent.name if run_dir.name.startswith("version_") else run_dir.name
    clash = sum(1 for r in runs if (r.parent.name if r.name.startswith("version_") else r.name) == name)
    return f"{name}/{run_dir.name}" if clash > 1 else name


def _interp(x: float, points: list[tuple[int, float]]) -> float:
    """Linear interpolation of `points` (sorted by step) at step x; totals start at 0 before step 0."""
    points = [(-1, 0.0), *points]
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if s0 <= x <= s1:
            return v0 if s1 == s0 else v0 + (v1 - v0) * (x - s0) / (s1 - s0)
    last_step, last = points[-1]
    per_step = last / (last_step + 1) if last_step >= 0 else 0.0
    return last + per_step * (x - last_step)  # past the last logged total: extrapolate its rate


def router_setting(arch: dict) -> str:
    """The router column: the router, its options, and where it routes when that is not every
    sublayer (two runs of one router that route different sublayers are different settings)."""
    router = str(arch.get("router", "?"))
    options = arch.get("router_options") or {}
    if options:
        router += " " + ", ".join(f"{k}={v}" for k, v in options.items())
    if router.startswith("none"):
        return router
    for kind, by_kind in (arch.get("router_options_by_kind") or {}).items():
        router += f"; {kind}: " + ", ".join(f"{k}={v}" for k, v in by_kind.items())
    where = []
    kinds = arch.get("route_kinds")
    if kinds is not None and sorted(kinds) != ["attn", "mlp"]:
        where.append("routes " + "+".join(kinds))
    if arch.get("route_layers", "all") != "all":
        where.append(f"layers {arch['route_layers']}")
    if arch.get("attend_skipped"):
        where.append("skipped tokens attendable")
    return "; ".join([router, *where])


def summarize(run_dir: Path, label: str) -> RunSummary:
    """The table row and the curve of one run."""
    cols = metric_columns(run_dir / "metrics.csv")
    if "flops/total" not in cols:
        totals = _checkpoint_totals(run_dir)
        if totals:
            last_step = max((s for v in cols.values() for s, _ in v), default=0)
            cols["flops/total"] = [(last_step, totals["flops/total"])]
            cols["flops/tokens"] = [(last_step, totals["flops/tokens"])]
            if "time/train_seconds" in totals:
                cols["time/train_seconds"] = [(last_step, totals["time/train_seconds"])]
    totals = sorted(cols.get("flops/total", []))
    seconds = sorted(cols.get("time/train_seconds", []))
    val = sorted(cols.get("val/bpb", []))
    curve = [(_interp(step, totals), bpb) for step, bpb in val] if totals else []
    time_curve = [(_interp(step, seconds), bpb) for step, bpb in val] if seconds else []
    last_step = totals[-1][0] if totals else max((s for v in cols.values() for s, _ in v), default=-1)
    fraction = [v for _, v in cols.get("flops/executed_fraction", [])]
    params = [v for _, v in cols.get("flops/executed_params_per_token", [])]
    from nag_lightning.checkpoints.settings import saved_architecture  # torch: only once there is a run

    hp = saved_architecture(_hparams(run_dir))
    return RunSummary(
        run=label, residual=str(hp.get("residual", "?")), router=router_setting(hp),
        steps=last_step + 1, tokens=int(cols["flops/tokens"][-1][1]) if totals else None,
        training_flops=totals[-1][1] if totals else math.nan,
        train_seconds=seconds[-1][1] if seconds else math.nan,
        executed_fraction=sum(fraction) / len(fraction) if fraction else math.nan,
        executed_params_per_token=sum(params) / len(params) if params else math.nan,
        final_val_bpb=val[-1][1] if val else math.nan, curve=curve, time_curve=time_curve,
    )


def markdown_table(rows: list[RunSummary]) -> str:
    head = ("| run | residual | router | steps | tokens seen | training FLOPs | training seconds "
            "| executed fraction | executed layer params/token | final val bits/byte |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(
            f"| {r.run} | {r.residual} | {r.router} | {r.steps} | {format_cell(r.tokens, ',')} "
            f"| {format_cell(r.training_flops, '.4g')} | {format_cell(r.train_seconds, ',.1f')} "
            f"| {format_cell(r.executed_fraction, '.3f')} "
            f"| {format_cell(r.executed_params_per_token, ',.0f')} | {format_cell(r.final_val_bpb, '.4f')} |"
        )
    return "\n".join(lines) + "\n"


def format_cell(value: float | int | None, spec: str) -> str:
    """`value` formatted, or '-' where the run did not log it ('' in CSV, where spec is '')."""
    if not spec and (value is None or (isinstance(value, float) and math.isnan(value))):
        return ""
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def plot(rows: list[RunSummary], path: Path) -> Path:
    """Val bits per byte against training FLOPs (left) and training seconds (right), one line per
    run, each run the same colour in both."""
    plt = pyplot()

    fig, (ax_flops, ax_time) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, r in enumerate(rows):
        label = f"{r.run} ({r.final_val_bpb:.3f})"
        for ax, curve in ((ax_flops, r.curve), (ax_time, r.time_curve)):
            if curve:
                x, y = zip(*curve)
                ax.plot(x, y, marker="o", markersize=3, color=f"C{i}", label=label)
    ax_flops.set(xlabel="training FLOPs", ylabel="validation bits per byte",
                 title="Validation bits per byte against training compute")
    ax_time.set(xlabel="training wall-clock seconds (validation left out)",
                ylabel="validation bits per byte", title="... and against training time")
    for ax in (ax_flops, ax_time):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return save(fig, path)


def compare(runs: list[str | Path], out: str | Path = "runs/compare") -> list[RunSummary]:
    """Summarise `runs`, write compare.csv, compare.md and compare.png into `out`, return the rows.

    Args:
        runs: run folders (with metrics.csv) or folders above them.
        out: folder for compare.csv/.md/.png.
    """
    run_dirs = find_runs(runs)
    rows = [summarize(d, _label(d, run_dirs)) for d in run_dirs]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: format_cell(v, "") for k, v in r.row().items()} for r in rows)
    (out / "compare.md").write_text(markdown_table(rows))
    plot(rows, out / "compare.png")
    return rows


def compare_command(args: list[str]) -> None:
    """`nag-lightning compare RUN [RUN ...] [--out DIR]`: a table of finished runs at their training
    FLOPs (printed, and written as CSV and markdown) and a plot of val bits per byte against them."""
    from nag_lightning.arguments import function_parser

    parser = function_parser(compare, "nag-lightning compare", compare_command.__doc__, skip=("runs",))
    parser.add_argument("runs", nargs="+", help="run folders (with metrics.csv) or folders above them")
    cfg = parser.parse_args(args)
    rows = compare(cfg.runs, cfg.out)
    print(markdown_table(rows), end="")
    missing = [r.run for r in rows if not r.has_flops]
    if missing:
        print(f"no FLOP totals ('-') for {', '.join(missing)}: train with "
              "nag_lightning.callbacks.FlopAccounting among trainer.callbacks to count them")
    print(f"wrote {Path(cfg.out) / 'compare.csv'}, compare.md and compare.png")
