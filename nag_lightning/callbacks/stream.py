"""What each write of the residual stream does to a token during training on a task: the data of
the diagnosis in docs/results_tasks.md ("Why NAG falls behind where depth matters").

At every validation, on the first validation batch of a task (its tokens carry difficulty labels),
per sublayer:

    angle_format, angle_answer   mean angle the write turned a token by (rad)
    near_zero, near_bound        NAG's gated angle: share of tokens under 10% / over 90% of its bound
    survive{k}_format / _answer  cosine of the state's direction between sublayer l and l + k,
                                 k = 1, 2, 4, 8: how much of a token's direction survives k writes
    norm                         the state norm after the write (pre-norm |x| / sqrt(d); NAG exp(rho))

and, at the readout, the logit scale by level and on right and wrong answers (what the norm lane
carries). Every `every_n_steps` training steps, after backward and before clipping: the gradient norm
reaching each sublayer's own weights, the rows of NAG's gate, the loss and the strategy's auxiliary
loss (NAG's price on turning). Written, one JSON object per line, to `stream_diagnostics.jsonl`
beside the logs; data only (`experiments/diagnosis_report.py` prints the tables).
"""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import torch
from torch import Tensor

from nag_lightning.residuals.nag import GateAngle
from nag_lightning.tasks import FORMAT, Labelled

SURVIVE = (1, 2, 4, 8)


def _unit(state: tuple[Tensor, ...]) -> Tensor:
    x = state[0].float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)


@torch.no_grad()
def diagnose(model, tokens: Tensor, difficulty: Tensor) -> dict:
    """Per-sublayer angles, direction survival and norms, and the readout's scale, on `tokens`
    (B, T + 1) with their labels."""
    strategy = model.strategy
    directions: list[Tensor] = []
    write = strategy.write

    def recording(state, f, gate, index, need_angle=True):
        new, angle = write(state, f, gate, index, need_angle)
        directions.append(_unit(new))
        return new, angle

    training = model.training
    model.eval()
    model.record_diagnostics(True)
    strategy.write = recording
    try:
        inputs, levels = tokens[:, :-1], difficulty[:, 1:]
        state = model.stream(inputs)
        logits = model.readout(state).float()
    finally:
        del strategy.write
        model.record_diagnostics(False)
        model.train(training)
    fmt, ans = levels == FORMAT, levels >= 1
    rows = []
    for i, sub in enumerate(model.sublayers):
        angle = sub.contribution.float()
        row = {"kind": sub.kind, "angle_format": angle[fmt].mean().item(),
               "angle_answer": angle[ans].mean().item(),
               "norm": sub.state_norm.float().mean().item()}
        if isinstance(getattr(strategy, "angle", None), GateAngle):
            share = angle / strategy.bound.of(i)  # NAG's gated angle, against its sublayer's bound
            row["near_zero"] = (share < 0.1).float().mean().item()
            row["near_bound"] = (share > 0.9).float().mean().item()
        for k in SURVIVE:
            if i + k < len(directions):
                cos = (directions[i] * directions[i + k]).sum(-1)
                row[f"survive{k}_format"] = cos[fmt].mean().item()
                row[f"survive{k}_answer"] = cos[ans].mean().item()
        rows.append(row)
    _, scale = strategy.final(state)
    readout = {}
    if scale is not None:
        scale = scale.squeeze(-1).float()
        right = logits.argmax(-1) == tokens[:, 1:]
        readout = {f"scale_k{k}": scale[levels == k].mean().item()
                   for k in range(int(levels.max()) + 1) if (levels == k).any()}
        readout["scale_right_answer"] = scale[ans & right].mean().item() if (ans & right).any() else None
        readout["scale_wrong_answer"] = scale[ans & ~right].mean().item() if (ans & ~right).any() else None
    return {"sublayers": rows, "readout": readout}


def gradient_norms(model) -> dict:
    """The gradient norm reaching each sublayer's weights, and each row of NAG's gate (None: no
    gradient yet)."""
    norms = []
    for sub in model.sublayers:
        grads = [p.grad.float().norm() for p in sub.compute.parameters() if p.grad is not None]
        norms.append(torch.linalg.vector_norm(torch.stack(grads)).item() if grads else 0.0)
    row = {"sublayer": norms}
    gate = getattr(getattr(model.strategy, "angle", None), "gate_w", None)
    if gate is not None and gate.grad is not None:
        row["gate"] = gate.grad.float().norm(dim=-1).tolist()
    return row


class StreamDiagnostics(L.Callback):
    """Records `diagnose` at every validation and the gradients reaching every sublayer during
    training, as JSON lines in `stream_diagnostics.jsonl` in the first logger's directory.

    Args:
        every_n_steps: training steps between two gradient records.
        sequences: validation sequences (of the first batch) the diagnosis reads.
    """

    def __init__(self, every_n_steps: int = 50, sequences: int = 64) -> None:
        self.every_n_steps, self.sequences = every_n_steps, sequences
        self._probe: Labelled | None = None
        self._pending: dict | None = None

    def _write(self, trainer: L.Trainer, row: dict) -> None:
        if trainer.is_global_zero and trainer.log_dir is not None:
            with open(Path(trainer.log_dir) / "stream_diagnostics.jsonl", "a") as out:
                out.write(json.dumps(row) + "\n")

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step + 1  # the step this backward belongs to
        if step % self.every_n_steps == 0:
            aux = pl_module.model.strategy.aux_loss()
            self._pending = {"step": step, **gradient_norms(pl_module.model),
                             "aux": None if aux is None else float(aux)}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._pending is not None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self._write(trainer, {"kind": "gradients", "loss": float(loss), **self._pending})
            self._pending = None

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, *_) -> None:
        if self._probe is None and batch_idx == 0 and isinstance(batch, Labelled):
            n = self.sequences
            self._probe = Labelled(batch.tokens[:n].clone(), batch.difficulty[:n].clone())

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._probe is None or trainer.sanity_checking:
            return
        model = pl_module.model
        probe = self._probe
        row = diagnose(model, probe.tokens.to(pl_module.device), probe.difficulty.to(pl_module.device))
        self._write(trainer, {"kind": "validation", "step": trainer.global_step, **row})
