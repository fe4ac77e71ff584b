"""The depth diagnostics figure: state norm and contribution angle against depth, one line per
validation, drawn from the history `nag_lightning.callbacks.DepthDiagnostics` records (in memory
at the end of a fit, or its `depth_diagnostics.json` afterwards)."""

from __future__ import annotations

import json
from pathlib import Path

from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.callbacks.depth import DepthDiagnostics


def draw_run_figures(trainer) -> list[Path]:
    """The figures of a finished fit, on the first rank: each `DepthDiagnostics` callback's
    history drawn where the callback names (`depth_diagnostics.png` beside the logs)."""
    if not trainer.is_global_zero:
        return []
    title = str(trainer.lightning_module.config.residual)
    return [plot_depth(callback.history, callback.figure_path(trainer), title)
            for callback in trainer.callbacks
            if isinstance(callback, DepthDiagnostics) and callback.history]


def plot_saved_depth(path: str | Path, title: str = "") -> Path:
    """The figure of a run's `depth_diagnostics.json`, drawn beside it as a PNG."""
    path = Path(path)
    return plot_depth(json.loads(path.read_text()), path.with_suffix(".png"), title)


def plot_depth(history: list[dict], path: Path, title: str) -> Path:
    """State norm and contribution angle against sublayer depth, one line per validation."""
    plt = pyplot()

    fig, (ax_norm, ax_angle) = plt.subplots(1, 2, figsize=(11, 4))
    labels = history[-1]["labels"]
    depth = range(len(labels))
    colors = plt.cm.viridis([i / max(len(history) - 1, 1) for i in range(len(history))])
    for entry, color in zip(history, colors):
        ax_norm.plot(depth, entry["norm"], color=color, label=f"step {entry['step']}")
        ax_angle.plot(depth, entry["mean"], color=color)
    last = history[-1]
    ax_angle.fill_between(depth, last["q0.1"], last["q0.9"], color=colors[-1], alpha=0.2,
                          label="10-90% of tokens (last)")
    norms = [v for entry in history for v in entry["norm"]]
    ax_norm.set(xlabel="sublayer (block_kind)", ylabel="state norm",
                yscale="log" if max(norms) > 10 * min(norms) > 0 else "linear",
                title=f"{title}: state norm after each sublayer")
    ax_angle.set(xlabel="sublayer (block_kind)", ylabel="contribution angle (rad)",
                 title=f"{title}: angle each sublayer turns the state")
    step = max(1, len(labels) // 12)  # at most a dozen tick labels
    for ax in (ax_norm, ax_angle):
        ax.set_xticks(list(depth)[::step], labels[::step], rotation=45, fontsize=7)
    ax_norm.legend(fontsize=7)
    ax_angle.legend(fontsize=7)
    return save(fig, path)
