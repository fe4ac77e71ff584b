"""Weight projection: keep the weights where the residual strategy's method puts them.

Some strategies constrain the weights themselves, not just the stream: nGPT (arXiv 2410.01131)
keeps every weight matrix unit-norm along the embedding axis by renormalizing after each optimizer
step. The strategy says how (`ResidualStrategy.project_weights`); this callback says when: once at
the start of fit, so training starts on the constraint, then after every optimizer step. The
LightningModule adds it on its own for a strategy that overrides `project_weights`
(`ResidualStrategy.training_callbacks` names it), so naming the strategy is enough to get the whole
method.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.strategies import FSDPStrategy


class WeightProjection(L.Callback):
    """Calls `pl_module.model.strategy.project_weights(pl_module.model)` at fit start and after
    every training batch (a batch that did not step leaves the weights already projected)."""

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(trainer.strategy, FSDPStrategy):
            # FSDP holds each rank's shard of a flattened parameter, not whole rows and columns.
            raise ValueError(
                f"The residual strategy {pl_module.config.residual!r} renormalizes whole weight "
                "matrices after each step, which FSDP's sharded parameters do not allow; train it "
                "with trainer.strategy=ddp (or a single device)."
            )
        pl_module.model.strategy.project_weights(pl_module.model)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        pl_module.model.strategy.project_weights(pl_module.model)
