"""Mixture-of-Depths routing statistics in the logs (DESIGN section 4).

Training: every `every_n_steps` steps, the last batch's MoD rate (whole model and per routed
sublayer), executed (token, sublayer) pairs, KV entries written, executed parameter fraction, the
routers' auxiliary losses and their own statistics (top-k predictor agreement, threshold tau, ...),
under `route/`. Validation: the same MoD rate and executed fraction accumulated over the whole
validation run, under `val_route/`; it can differ from training's, because top-k routes with its
causal predictor in evaluation.
"""

from __future__ import annotations

from collections import defaultdict

import lightning as L
import torch

from nag_lightning.model.routing_stats import routing_stats


def _seq_len(batch: torch.Tensor) -> int:
    """The model reads batch[:, :-1] (inputs) and predicts batch[:, 1:] (LanguageModel._loss)."""
    return batch.shape[-1] - 1


class RoutingStats(L.Callback):
    """Logs `route/mod_rate`, `route/mod_rate/{block}_{kind}`, `route/executed_tokens`,
    `route/kv_entries`, `route/executed_param_fraction`, `route/aux_loss` and router statistics
    while training, and `val_route/...` per validation run.

    Args:
        every_n_steps: log every this many training steps; None follows trainer.log_every_n_steps.
        per_sublayer: also log each routed sublayer's MoD rate and statistics.
    """

    def __init__(self, every_n_steps: int | None = None, per_sublayer: bool = True) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"RoutingStats.every_n_steps must be at least 1 or null; got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.per_sublayer = per_sublayer
        self._val: dict[str, list[float]] = defaultdict(list)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self.every_n_steps or trainer.log_every_n_steps
        if trainer.global_step % every:
            return
        stats = routing_stats(pl_module.model, _seq_len(batch), self.per_sublayer)
        pl_module.log_dict({f"route/{k}": v for k, v in stats.items()}, on_step=True, on_epoch=False)

    def on_validation_epoch_start(self, trainer, pl_module) -> None:
        self._val = defaultdict(list)

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *_) -> None:
        stats = routing_stats(pl_module.model, _seq_len(batch), per_sublayer=False)
        for key in ("mod_rate", "executed_param_fraction", "predictor_agreement"):
            if key in stats:
                self._val[key].append(stats[key])

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not self._val or trainer.sanity_checking:
            return
        pl_module.log_dict({f"val_route/{k}": sum(v) / len(v) for k, v in self._val.items()})
