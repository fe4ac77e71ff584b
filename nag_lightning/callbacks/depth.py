"""Depth diagnostics: per-sublayer state norm and contribution angle against depth.

This is the paper's central picture (arXiv 2606.16112, claim 1): in a pre-norm stream the state norm
grows with depth and each later sublayer turns the state by a smaller angle; under NAG the angle
stays meaningful at every depth. Logged at every validation and written as JSON at the end of fit;
the figure is analysis's (`nag_lightning.analysis.reports.depth`, which `nag-lightning fit` runs
when the fit ends).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from nag_lightning.model.routing_stats import sublayer_label

QUANTILES = (0.1, 0.5, 0.9)


class DepthDiagnostics(L.Callback):
    """Logs `depth/angle_mean/{i}_{kind}`, angle quantiles and `depth/state_norm/{i}_{kind}` for
    every sublayer at validation, and writes their history as `depth_diagnostics.json` beside the
    logs at fit end, the data of the figure `depth_diagnostics.png` that `nag-lightning fit` draws
    from it (`nag_lightning.analysis.reports.depth`).

    Args:
        max_samples: per-sublayer token angles kept for the quantiles at each validation.
        filename: name of the PNG drawn into the first logger's directory; the JSON beside it
            takes its name with the suffix .json.
    """

    def __init__(self, max_samples: int = 65536, filename: str = "depth_diagnostics.png") -> None:
        self.max_samples = max_samples
        self.filename = filename
        self.history: list[dict] = []  # one entry per validation: step, angle stats, state norms
        self._angles: list[list[Tensor]] = []
        self._norms: list[list[Tensor]] = []

    def on_validation_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.model.record_diagnostics(True)
        n = len(pl_module.model.sublayers)
        self._angles = [[] for _ in range(n)]
        self._norms = [[] for _ in range(n)]

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *_) -> None:
        for i, sublayer in enumerate(pl_module.model.sublayers):
            kept = sum(a.numel() for a in self._angles[i])
            if kept < self.max_samples:
                self._angles[i].append(sublayer.contribution.flatten()[: self.max_samples - kept].cpu())
            self._norms[i].append(sublayer.state_norm.float().mean().cpu())

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pl_module.model.record_diagnostics(False)
        if not self._norms or not self._norms[0]:
            return
        entry = {"step": trainer.global_step, "labels": [], "mean": [], "norm": []}
        entry.update({f"q{q}": [] for q in QUANTILES})
        for i, sublayer in enumerate(pl_module.model.sublayers):
            angles = torch.cat(self._angles[i]).float()
            label = sublayer_label(sublayer)
            entry["labels"].append(label)
            entry["mean"].append(angles.mean().item())
            entry["norm"].append(torch.stack(self._norms[i]).mean().item())
            for q, value in zip(QUANTILES, torch.quantile(angles, torch.tensor(QUANTILES))):
                entry[f"q{q}"].append(value.item())
            pl_module.log(f"depth/angle_mean/{label}", entry["mean"][-1])
            pl_module.log(f"depth/angle_q50/{label}", entry["q0.5"][-1])
            pl_module.log(f"depth/state_norm/{label}", entry["norm"][-1])
        if not trainer.sanity_checking:
            self.history.append(entry)

    def figure_path(self, trainer: L.Trainer) -> Path:
        """Where the figure of this run's diagnostics goes: the first logger's directory."""
        return Path(trainer.log_dir or trainer.default_root_dir) / self.filename

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.history and trainer.is_global_zero:
            # The numbers behind the picture, for the figure and side-by-side figures across runs.
            path = self.figure_path(trainer).with_suffix(".json")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.history))

    def state_dict(self) -> dict:
        return {"history": self.history}

    def load_state_dict(self, state_dict: dict) -> None:
        """The history saved in a checkpoint, untrusted input: entries that are not what
        `on_validation_end` records (the plot reads them at the end of training) are dropped, with
        one warning."""
        history = state_dict.get("history", []) if isinstance(state_dict, dict) else None
        history = history if isinstance(history, list) else [history]
        self.history = [entry for entry in history if _is_entry(entry)]
        if len(self.history) != len(history):
            rank_zero_warn(
                f"The checkpoint's {type(self).__name__} history holds "
                f"{len(history) - len(self.history)} entries that are not depth diagnostics; they "
                "were dropped."
            )


def _is_entry(entry: object) -> bool:
    """Whether `entry` is one validation's diagnostics: a step and equally long lists of labels
    and numbers."""
    step = entry.get("step") if isinstance(entry, dict) else None
    if isinstance(step, bool) or not isinstance(step, int):
        return False
    labels = entry.get("labels")
    if not isinstance(labels, list) or not all(isinstance(label, str) for label in labels):
        return False
    numbers = [entry.get(key) for key in ("mean", "norm", *(f"q{q}" for q in QUANTILES))]
    return all(isinstance(values, list) and len(values) == len(labels)
               and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
               for values in numbers)
