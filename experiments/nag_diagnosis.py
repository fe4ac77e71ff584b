"""Diagnostics of a residual stream during training on a task: what each write does to a token.

Used by `task_depth_probe.py --diagnose` (docs/results_tasks.md, "Why NAG is behind"; the probe's
last version is `git show 903e526:experiments/task_depth_probe.py`). Every
`--eval_every` steps, on 64 evaluation sequences, per sublayer:

    angle            mean angle the write turned a token by (rad), at format and at answer tokens
    near_zero, near_bound   share of tokens turned by under 10% / over 90% of NAG's bound
    survive_k        cosine of the state direction between sublayer l and l + k, k = 1, 2, 4, 8
                     (how much of a token's direction survives k writes), at format and answers
    norm             the state norm (pre-norm |x| / sqrt(d); NAG exp(rho)) after the write
and, at the readout, the logit scale by level and for right and wrong answers (what the norm lane
carries). `GradientLog` records, every few steps, the gradient norm reaching each sublayer's own
weights (attention or MLP) and the NAG gate's, before clipping.
"""

from __future__ import annotations

import torch
from torch import Tensor

from nag_lightning.tasks import FORMAT

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
        model.train()
    fmt, ans = levels == FORMAT, levels >= 1
    bound = getattr(strategy, "theta_max", None)
    rows = []
    for i, sub in enumerate(model.sublayers):
        angle = sub.contribution.float()
        row = {"kind": sub.kind, "angle_format": angle[fmt].mean().item(), "angle_answer": angle[ans].mean().item(),
               "norm": sub.state_norm.float().mean().item()}
        if bound is not None and getattr(strategy, "angle", None) == "gate":
            share = angle / bound
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


class GradientLog:
    """The gradient norm reaching each sublayer's weights (and NAG's gate row of it), after backward
    and before clipping, every `every` steps."""

    def __init__(self, model, every: int = 50) -> None:
        self.model, self.every, self.rows = model, every, []

    def __call__(self, step: int, loss: float, aux: float) -> None:
        if step % self.every:
            return
        norms = []
        for sub in self.model.sublayers:
            grads = [p.grad for p in sub.compute.parameters() if p.grad is not None]
            norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item() if grads else 0.0)
        row = {"step": step, "loss": loss, "aux": aux, "sublayer": norms}
        gate = getattr(self.model.strategy, "gate_w", None)
        if gate is not None and gate.grad is not None:
            row["gate"] = gate.grad.norm(dim=-1).tolist()
        self.rows.append(row)
