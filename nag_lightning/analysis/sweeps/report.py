"""The rows of a sweep, written as `sweep.csv`, drawn as `sweep.png` and printed."""

from __future__ import annotations

import csv
from dataclasses import asdict, dataclass
from pathlib import Path

from nag_lightning.analysis.reports.plotting import pyplot, save

ORACLE = "oracle"


@dataclass
class SweepRow:
    """One evaluated setting.

    Attributes:
        method: the router swept ("threshold", "topk": exact, non-causal top-k, or any other
            router's name), "oracle", or a router's row as trained ("topk_predictor").
        setting: the router's swept setting: "tau" (radians), "capacity", ...
        value: the setting's value.
        mod_rate: skipped (token, sublayer) executions over all of them, whole model.
        flops_per_token: executed forward FLOPs per token (for the oracle: what its skips would
            cost if they were free to find, which they are not).
        executed_fraction: flops_per_token over the full-depth model's.
        val_loss: next-token cross-entropy in nats.
        bpb: bits per byte: the loss summed over the target tokens, in bits, over the bytes they
            stand for (val_loss / ln 2 for a byte-level model).
        predictor_agreement: top-k only: causal predictor's agreement with the exact top-k.
        val_batches: validation batches the setting was evaluated on (the run's own val/bpb
            averaged over its trainer.limit_val_batches, so the full-depth bpb can differ).
    """

    method: str
    setting: str
    value: float
    mod_rate: float
    flops_per_token: float
    executed_fraction: float
    val_loss: float
    bpb: float
    predictor_agreement: float | None = None
    val_batches: int = 0


def write_csv(rows: list[SweepRow], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in asdict(row).items()})
    return path


ORACLE_LABEL = "oracle: skips on the measured angle (upper bound, saves no compute)"
ORACLE_TRAINED_ROUTED = "oracle: skips on the measured angle (saves no compute; no bound here)"


def plot(rows: list[SweepRow], path: Path, title: str, trained_routed: bool = False,
         as_trained: tuple[str, ...] = (), labels: dict[str, str] | None = None) -> Path:
    """Bits per byte against executed forward FLOPs per token, one line per method (a point for
    each method in `as_trained`, the routers as trained), labelled by `labels` (the router's
    `sweep_labels`) or by name; the MoD rates label the points of each swept router. The oracle
    bounds post-training routing; a model trained with routing never ran dense, so there it is
    only a reference (`trained_routed` says so in its label)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    methods = list(dict.fromkeys(r.method for r in rows))
    for method in methods:
        points = sorted((r.flops_per_token, r.bpb, r.mod_rate) for r in rows if r.method == method)
        setting = next(r.setting for r in rows if r.method == method)
        x, y, rate = zip(*points)
        swept = method not in as_trained
        style = "s--" if method == ORACLE else ("o-" if swept else "*")
        if method == ORACLE:
            label = ORACLE_TRAINED_ROUTED if trained_routed else ORACLE_LABEL
        else:
            label = (labels or {}).get(
                method, f"{method} (sweep of {setting})" if swept else f"{method} (as trained)")
        ax.plot(x, y, style, label=label, markersize=9 if style == "*" else 5)
        if swept and method != ORACLE:
            for xi, yi, ri in zip(x, y, rate):
                ax.annotate(f"{100 * ri:.0f}%", (xi, yi), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set(xlabel="executed forward FLOPs per token", ylabel="validation bits per byte",
           title=f"{title} (labels: MoD rate)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path)


def report(path: Path) -> None:
    """Print the rows of a written sweep.csv."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        print(f"{row['method']:>15} {row['setting']}={float(row['value']):.4g}  "
              f"MoD {100 * float(row['mod_rate']):5.1f}%  "
              f"FLOPs/token {float(row['flops_per_token']):.4g}  bpb {float(row['bpb']):.4f} "
              f"({row['val_batches']} val batches)"
              + (f"  agreement {float(row['predictor_agreement']):.3f}"
                 if row["predictor_agreement"] else ""))
    print(f"bits per byte over {rows[0]['val_batches']} validation batches (--val_batches); the run's "
          "own val/bpb averaged over its trainer.limit_val_batches, so full depth can differ from it")
