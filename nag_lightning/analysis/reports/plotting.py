"""The one place figures are started and saved: headless matplotlib, imported only when drawing."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the file-only Agg backend (no display needed, safe in workers)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    """Lay out, write as PNG (creating the folder) and free the figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return path
