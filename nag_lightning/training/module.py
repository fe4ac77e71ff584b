"""The LightningModule: a `Transformer` trained as a language model on the data's tokens.

Loss is cross-entropy on next-token prediction. The reported metric is bits per byte: the loss
summed over the target tokens, in bits, divided by the bytes those tokens stand for, so runs on
different tokenizers compare (for bytes it is loss / ln 2); the loss per token is logged beside it.
The optimizer and the learning-rate schedule (AdamW with linear warmup, then cosine decay over the
steps, or warmup-stable-decay (WSD) whose decay fills the last `decay_fraction` of a FLOP budget)
are `nag_lightning.training.optim`'s; gradient clipping is the Trainer's (`trainer.gradient_clip_val`).
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
from dataclasses import asdict

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torchmetrics import MeanMetric

from nag_lightning.checkpoints.loading import token_byte_lengths
from nag_lightning.checkpoints.settings import architecture_differences, check_architecture
from nag_lightning.data import tokenizer as tokenizers
from nag_lightning.data.tokenizer import Tokenizer
from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.model.compile import compile_model
from nag_lightning.tasks import Labelled
from nag_lightning.tasks.evaluation import DifficultyScores, score_batch
from nag_lightning.training.optim import (  # noqa: F401 - importable here as before
    SCHEDULES,
    RunBudget,
    adamw,
    fused_adamw,
    lr_factor,
    warmup_cosine,
    warmup_stable_decay,
)


class BitsPerByte(MeanMetric):
    """Cross-entropy per byte, in bits: update with (loss per byte in nats, bytes) per batch, so the
    result is the loss summed over all target tokens over the bytes they stand for, / ln 2."""

    def compute(self) -> Tensor:
        return super().compute() / math.log(2)


class LanguageModel(L.LightningModule):
    """Transformer language model with a pluggable residual stream and router.

    Args:
        arch: the Transformer's architecture, `nag_lightning.model.TransformerConfig`: widths,
            depth, sequence length, the residual strategy and the router with their options.
        lr: peak learning rate.
        min_lr_ratio: final learning rate of the decay, as a fraction of lr.
        warmup_steps: linear warmup steps.
        schedule: "cosine": after warmup, cosine decay to min_lr_ratio at the last step
            (trainer.max_steps, or the steps of max_epochs). "wsd" (warmup-stable-decay): after
            warmup, lr holds until the last `decay_fraction` of the run, then falls linearly to
            min_lr_ratio; the run's progress is the fraction of the FLOP budget spent when a
            FlopBudget callback follows the run (`follow_budget`), else the fraction of the steps.
        decay_fraction: the final fraction of the run (FLOP budget or steps) WSD decays over.
        weight_decay: AdamW weight decay of matrices (gains, scalars and embeddings get none).
        betas: AdamW betas.
        aux_loss_weight: weight of the auxiliary losses (the routers' and the residual strategy's)
            in the training loss.
        compile: compile the model with torch.compile when the Trainer sets it up
            (`nag_lightning.model.compile`); the state dict and checkpoints are unchanged.
        init_weights: start from the weights of a folder written by `nag-lightning export` (or of
            a .ckpt file): they must fit `arch`, and their tokenizer must be the data's; training
            starts at step 0 with a new optimizer. Not saved in checkpoints (the weights are).
    """

    def __init__(
        self,
        arch: TransformerConfig = TransformerConfig(),  # noqa: B008 - jsonargparse reads its fields
        lr: float = 3e-3,
        min_lr_ratio: float = 0.1,
        warmup_steps: int = 50,
        schedule: str = "cosine",
        decay_fraction: float = 0.2,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        aux_loss_weight: float = 1.0,
        compile: bool = False,
        init_weights: str | None = None,
    ) -> None:
        super().__init__()
        # A copy (the default is shared); a checkpoint's hyperparameters hold the config as a dict.
        self.config = TransformerConfig(**(asdict(arch) if isinstance(arch, TransformerConfig) else arch))
        # save_hyperparameters reads this frame's arguments: the config goes in as plain data, so
        # checkpoints load with weights_only=True
        arch = asdict(self.config)
        self.save_hyperparameters(ignore=["init_weights"])
        if lr <= 0 or warmup_steps < 0 or not 0 <= min_lr_ratio <= 1:
            raise ValueError(
                "Need lr > 0, warmup_steps >= 0 and min_lr_ratio in [0, 1]; got "
                f"lr={lr}, warmup_steps={warmup_steps}, min_lr_ratio={min_lr_ratio}."
            )
        if schedule not in SCHEDULES or not 0 < decay_fraction <= 1:
            raise ValueError(
                f"model.schedule must be one of {', '.join(SCHEDULES)} and model.decay_fraction in "
                f"(0, 1]; got schedule={schedule!r}, decay_fraction={decay_fraction}."
            )
        self.model = Transformer(self.config)
        self.routed = any(s.routed for s in self.model.sublayers)
        self.val_bpb, self.val_loss = BitsPerByte(), MeanMetric()
        self.test_bpb, self.test_loss = BitsPerByte(), MeanMetric()
        self.val_by_difficulty = DifficultyScores()  # filled by task data's labelled batches only
        # The tokenizer of the data (from the data module at setup, or from a checkpoint): its
        # per-id byte counts turn the loss into bits per byte, and generation encodes with it.
        self.tokenizer: Tokenizer = Tokenizer()
        self._tokenizer_from_data = False
        self.register_buffer("token_bytes", None, persistent=False)  # None: one byte per token
        self.budget: RunBudget | None = None  # set by `follow_budget`
        self._init_tokenizer: Tokenizer | None = None
        if init_weights is not None:
            self._start_from(init_weights)

    def _start_from(self, path: str) -> None:
        """Take the weights and the tokenizer of `path` (`init_weights`), read once through the
        checkpoint reader; the architecture is this module's own, so nothing the file names is
        built."""
        from nag_lightning.checkpoints.reader import fitting_weights, read_saved

        saved = read_saved(path)
        differences = architecture_differences(saved.arch, asdict(self.config))
        if differences:
            raise ValueError(
                f"model.init_weights={path!r} holds weights of another architecture: "
                f"{', '.join(differences)}; set model.arch as its config.json (or its run's "
                "config.yaml) says."
            )
        weights = saved.model_weights
        with fitting_weights(self.model.state_dict(), weights, saved.source):
            self.model.load_state_dict(weights)
        self._init_tokenizer, self._init_source = saved.tokenizer, saved.source
        self.set_tokenizer(saved.tokenizer)

    def configure_model(self) -> None:
        """Shard the model under Lightning's ModelParallelStrategy (FSDP2, one unit per block,
        `nag_lightning.training.sharding`; other strategies wrap the model themselves), then compile it when
        asked: this is the Trainer's hook for changing the model once the strategy has placed it."""
        if self.device_mesh is not None:
            from nag_lightning.training.sharding import fully_shard_transformer

            fully_shard_transformer(self.model, self.device_mesh)
        if self.hparams.compile and self.model._compiled_call_impl is None:
            compile_model(self.model)

    def setup(self, stage: str) -> None:
        """Take the data's tokenizer; refuse a vocabulary smaller than its token ids, before an
        embedding lookup fails on the first batch."""
        tokenizer = getattr(self.trainer.datamodule, "tokenizer", None)
        initial = self._init_tokenizer
        if isinstance(tokenizer, Tokenizer) and initial is not None and initial != tokenizer:
            wanted = ("bytes" if initial.key == tokenizers.BYTES else
                      f"the tokenizer.json of {self._init_source} (`nag-lightning export` writes it)")
            raise ValueError(
                f"model.init_weights was trained on tokens of {initial.describe()}, but this run's "
                f"data uses {tokenizer.describe()}; give data.tokenizer={wanted}."
            )
        if isinstance(tokenizer, Tokenizer):
            self.set_tokenizer(tokenizer)
            self._tokenizer_from_data = True
        needed = getattr(self.trainer.datamodule, "vocab_size", None)
        if needed is not None and self.config.vocab_size < needed:
            raise ValueError(
                f"model.arch.vocab_size={self.config.vocab_size} is smaller than the {needed} token ids "
                f"of data.tokenizer={self.tokenizer.spec!r}; set model.arch.vocab_size to at least "
                f"{needed}, or leave it out: the command line sets it from data.tokenizer."
            )

    def set_tokenizer(self, tokenizer: Tokenizer) -> None:
        """Use `tokenizer` for bits per byte, checkpoints and generation."""
        self.tokenizer = tokenizer
        self.token_bytes = token_byte_lengths(tokenizer, self.config.vocab_size, self.device)

    def _bytes(self, targets: Tensor) -> Tensor | int:
        """The bytes the target tokens stand for (their number, for bytes)."""
        if self.token_bytes is None:
            return targets.numel()
        return self.token_bytes[targets].sum().clamp_min(1)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx).logits

    def _loss(self, batch: Tensor) -> tuple[Tensor, Tensor]:
        """Next-byte cross-entropy (nats) of batch (B, T + 1), and the routers' auxiliary loss."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        out = self.model(inputs)
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten())
        return loss, out.aux_loss

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        if self.routed:  # the routers' skip-rate warm-up follows the run's progress, as WSD does
            total = max(self.trainer.estimated_stepping_batches, 1)
            self.model.set_progress(self._progress(total)(self.global_step))
        loss, aux = self._loss(batch)
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"The training loss became {loss.item()} at step {self.global_step}; the "
                "checkpoints already written are kept. Lower model.lr, raise "
                "model.warmup_steps or set trainer.gradient_clip_val, then "
                + self._resume_advice()
            )
        self.log("train/loss", loss, prog_bar=True)  # per token, nats
        self.log("train/lr", self.optimizers().param_groups[0]["lr"])
        tokens = batch[:, 1:].numel()
        self.log("train/bpb", loss * (tokens / self._bytes(batch[:, 1:])) / math.log(2))
        if self.routed:
            self.log("train/aux_loss", aux)
        return loss + self.hparams.aux_loss_weight * aux

    def on_validation_start(self) -> None:
        """Say in the logs when a router's evaluation routing is not to be trusted yet."""
        for note in sorted({n for s in self.model.sublayers if (n := s.router.evaluation_note())}):
            rank_zero_warn(note)

    def on_after_backward(self) -> None:
        """Routers learn thresholds outside the gradients; with activation checkpointing they
        apply them here, once backward has run every block's forward again."""
        self.model.apply_router_updates()

    def _resume_advice(self) -> str:
        """Where a diverged run can be resumed from: the newest checkpoint on disk (the CLI's
        `RunCheckpoint` writes only finite states, and says so with `writes_only_finite`)."""
        for callback in self.trainer.checkpoint_callbacks:
            for path in (getattr(callback, "last_model_path", ""), getattr(callback, "best_model_path", "")):
                if path and os.path.isfile(path):
                    kind = "finite " if getattr(callback, "writes_only_finite", False) else ""
                    return f"resume from the newest {kind}checkpoint with --ckpt_path {path}."
        return "start again: no checkpoint was written before the loss diverged."

    def _evaluate(self, batch: Tensor, bpb: BitsPerByte, per_token: MeanMetric, stage: str,
                  loss: Tensor | None = None) -> None:
        if loss is None:
            loss, _ = self._loss(batch)
        tokens = batch[:, 1:].numel()
        n_bytes = self._bytes(batch[:, 1:])
        # weighted by bytes, the mean of (loss per byte) is the summed loss over the summed bytes
        bpb.update(loss * (tokens / n_bytes), weight=n_bytes)
        per_token.update(loss, weight=tokens)
        self.log(f"{stage}/bpb", bpb, prog_bar=stage == "val")
        self.log(f"{stage}/loss_per_token", per_token)

    def validation_step(self, batch: Tensor | Labelled, batch_idx: int) -> None:
        if isinstance(batch, Labelled):  # task data: also scored per difficulty level
            scores = score_batch(self.model, batch)
            self.val_by_difficulty.update(scores)
            self._evaluate(batch.tokens, self.val_bpb, self.val_loss, "val", scores.loss.mean())
            return
        self._evaluate(batch, self.val_bpb, self.val_loss, "val")

    def on_validation_epoch_end(self) -> None:
        """Log accuracy, loss and compute per difficulty level (`nag_lightning.tasks.evaluation`)."""
        if self.val_by_difficulty.update_called:
            values = self.val_by_difficulty.compute()
            self.log_dict({f"val/difficulty/{name}": value for name, value in values.items()})
            self.val_by_difficulty.reset()

    def test_step(self, batch: Tensor, batch_idx: int) -> None:
        self._evaluate(batch, self.test_bpb, self.test_loss, "test")

    def predict_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        """Per-sequence bits per byte of each batch item."""
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model(inputs).logits.float()
        nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
        if self.token_bytes is None:
            return nll.mean(1) / math.log(2)
        return nll.sum(1) / self.token_bytes[targets].sum(1).clamp_min(1) / math.log(2)

    def configure_optimizers(self):
        """AdamW over `parameter_groups` and the learning-rate schedule (`lr_factor`), both from
        `nag_lightning.training.optim`, the one definition of the two in the package."""
        hp = self.hparams
        optimizer = adamw(self.model, hp.lr, tuple(hp.betas), hp.weight_decay,
                          clips_mixed_precision="mixed" in str(self.trainer.precision)
                          and bool(self.trainer.gradient_clip_val))
        total = max(self.trainer.estimated_stepping_batches, 1)
        if hp.schedule == "cosine" and hp.min_lr_ratio < 1 and self.budget is not None:
            rank_zero_warn(
                "The cosine schedule decays over trainer.max_steps, not the FLOP budget, which "
                "ends the run wherever it is on that curve; set model.schedule: wsd to anneal "
                "at the end of the budget."
            )
        progress = self._progress(total)
        factor = lambda step: lr_factor(hp.schedule, step, hp.warmup_steps, total, progress(step),
                                        hp.decay_fraction, hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def follow_budget(self, budget: RunBudget | None) -> None:
        """Hook for a compute budget that ends the run: a `FlopBudget` callback calls it at setup,
        before the optimizers are configured, so WSD reads the run's progress from it; None: from
        the steps again."""
        self.budget = budget

    def teardown(self, stage: str) -> None:
        """Forget the budget of this run: a later one on another Trainer sets its own."""
        self.budget = None

    def _progress(self, total: float):
        """step -> fraction of the run done, for WSD: of the FLOP budget when one follows the run
        (its spent FLOPs are checkpointed, so a resumed run continues the same schedule), else of
        the steps."""
        budget = self.budget
        if budget is not None:
            return lambda step: budget.progress
        return lambda step: step / total

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path,
        map_location=None,
        hparams_file=None,
        strict: bool | None = None,
        weights_only: bool | None = True,
        trust_checkpoint: bool = False,
        **kwargs,
    ) -> LanguageModel:
        """Lightning's loader, the checkpoint read once and checked as untrusted input by the one
        loader (`from_saved`): a plugin named by a class path outside the registries is refused
        unless `trust_checkpoint`. Keyword arguments override the saved settings, as in Lightning."""
        from nag_lightning.checkpoints.reader import read_saved, refuse_full_unpickle

        refuse_full_unpickle(weights_only, "leave weights_only unset")
        if hparams_file is not None:
            raise ValueError(
                "hparams_file is not read: a checkpoint of `nag-lightning fit` holds its settings."
            )
        if strict is False:
            raise ValueError("strict=False is not supported: a checkpoint of `nag-lightning fit` "
                             "holds every weight of its model; leave strict unset.")
        module = cls.from_saved(read_saved(checkpoint_path), trust_checkpoint, **kwargs)
        return module if map_location is None else module.to(map_location)

    @classmethod
    def from_saved(cls, saved, trust_checkpoint: bool = False, **kwargs) -> LanguageModel:
        """The module a `nag_lightning.checkpoints.reader.SavedCheckpoint` holds: its settings,
        `kwargs` on top, and the model and tokenizer that `load_model` builds from that one read,
        after every check (plugins, sizes, values, tokenizer); `trust_checkpoint` as there."""
        from nag_lightning.checkpoints.loading import load_model

        loaded = load_model(saved, trust_checkpoint=trust_checkpoint, arch=kwargs.get("arch"),
                            replaced=kwargs)
        settings = {**saved.settings, **kwargs, "arch": loaded.model.cfg}
        accepted = inspect.signature(cls.__init__).parameters
        module = cls(**{k: v for k, v in settings.items() if k in accepted})
        # the loaded model in place of the freshly initialised one the constructor built
        module.model = loaded.model.train()
        module.set_tokenizer(loaded.tokenizer)
        return module

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """`nn.Module.load_state_dict`; weights that do not fit are said in one sentence."""
        from nag_lightning.checkpoints.reader import fitting_weights

        with fitting_weights(self.state_dict(), state_dict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def configure_callbacks(self) -> list[L.Callback]:
        """The callbacks the residual strategy needs (`ResidualStrategy.training_callbacks`, named by
        class path, so neither the model nor this module imports a callback): e.g. nGPT's
        renormalization of the weights after each step."""
        callbacks = []
        for path in self.model.strategy.training_callbacks:
            module_name, _, class_name = path.rpartition(".")
            callbacks.append(getattr(importlib.import_module(module_name), class_name)())
        return callbacks

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Keep the tokenizer in the checkpoint, as plain data (it loads with weights_only=True)."""
        checkpoint["tokenizer"] = self.tokenizer.saved()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """Take the checkpoint's tokenizer; refuse, in one sentence, a checkpoint whose tokenizer
        differs from the data's or whose architecture differs from this model's."""
        saved = tokenizers.load_saved(checkpoint.get("tokenizer"))
        if self._tokenizer_from_data and saved.key != self.tokenizer.key:
            raise ValueError(
                f"The checkpoint was trained on tokens of {saved.describe()}, but this run's data "
                f"uses {self.tokenizer.describe()}; set data.tokenizer (and data.source) as the "
                "checkpoint's run did, e.g. from its config.yaml."
            )
        tokenizers.check_fits(saved, self.config.vocab_size)
        self.set_tokenizer(saved)
        check_architecture(checkpoint.get("hyper_parameters", {}), asdict(self.config))


NAGLanguageModel = LanguageModel
"""The name of earlier releases (it trains any residual strategy), kept for their configs."""
