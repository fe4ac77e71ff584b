"""Evaluation by difficulty: accuracy, loss and the compute every token received, per label level.

A target token's label says what predicting it needs (`nag_lightning.tasks`: -1 unpredictable,
0 format, k >= 1 steps). For each target the model is scored on exact match (argmax = target) and
cross-entropy, and the compute spent at the input position that predicts it is read from the
sublayers (`Transformer.record_diagnostics`):

    angle     the contribution angle summed over sublayers (every residual strategy), radians
    planned   the strategy's planned angle summed over sublayers (NAG's gated angle), or NaN
    executed  the number of sublayers the routers ran for it (all of them without a router)

The LightningModule logs these per level at each validation on task data (`DifficultyScores`);
`evaluate_by_difficulty` runs the same on any model and labelled sequences outside a Trainer,
returning a table per level and the per-token arrays (for a rank correlation between compute and
difficulty, `spearman`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.functional import spearman_corrcoef
from torchmetrics.utilities import dim_zero_cat

from nag_lightning.model import Transformer
from nag_lightning.model.flops import count_model
from nag_lightning.routers import Route
from nag_lightning.tasks import FORMAT, TASKS, UNPREDICTABLE, Labelled, build_task


@dataclass
class TokenScores:
    """Per target token, all of one shape: its label, whether the argmax hit it, its loss (nats),
    and the compute at the position that predicts it."""

    difficulty: Tensor
    correct: Tensor
    loss: Tensor
    angle: Tensor
    planned: Tensor
    executed: Tensor
    executed_attn: Tensor  # of `executed`, the attention sublayers (a routed MLP skips apart)
    executed_mlp: Tensor

    def flat(self) -> TokenScores:
        return TokenScores(*(getattr(self, f.name).flatten() for f in fields(self)))


def level_name(level: int) -> str:
    """"unpredictable", "format", or "k<steps>": the name a level is logged under."""
    return {UNPREDICTABLE: "unpredictable", FORMAT: "format"}.get(level, f"k{level}")


def score_batch(model: Transformer, batch: Labelled) -> TokenScores:
    """Run `model` on `batch` (tokens and labels (B, T + 1)) recording every sublayer, and score its
    T targets; the model's recording setting is restored after."""
    inputs, targets = batch.tokens[:, :-1], batch.tokens[:, 1:]
    sublayers = model.sublayers
    was_recording = [s.record for s in sublayers]
    model.record_diagnostics(True)
    try:
        logits = model(inputs).logits.float()  # (B, T, vocab)
    finally:
        for sublayer, recording in zip(sublayers, was_recording):
            sublayer.record = recording
    planned = [s.planned_angle for s in sublayers]
    return TokenScores(
        difficulty=batch.difficulty[:, 1:],
        correct=logits.argmax(-1) == targets,
        loss=F.cross_entropy(logits.transpose(1, 2), targets, reduction="none"),  # (B, T)
        angle=sum(s.contribution.float() for s in sublayers),
        planned=(sum(p.float() for p in planned) if all(p is not None for p in planned)
                 else torch.full(targets.shape, float("nan"), device=targets.device)),
        executed=sum(s.executed.float() for s in sublayers),
        executed_attn=sum(s.executed.float() for s in sublayers if s.kind == "attn"),
        executed_mlp=sum(s.executed.float() for s in sublayers if s.kind == "mlp"),
    )


def level_table(scores: TokenScores, n_sublayers: int) -> list[dict]:
    """One row per label level present: its name, token count, accuracy (None for unpredictable
    tokens), mean loss, mean angle, planned angle and executed sublayers, and the skip rate, over
    every sublayer and over each kind's (`skip_rate_attn`, `skip_rate_mlp`)."""
    scores = scores.flat()
    rows = []
    for level in map(int, scores.difficulty.unique().tolist()):
        mask = scores.difficulty == level
        executed = scores.executed[mask].mean().item()
        rows.append({
            "level": level, "name": level_name(level), "count": int(mask.sum()),
            "accuracy": None if level == UNPREDICTABLE else scores.correct[mask].float().mean().item(),
            "loss": scores.loss[mask].mean().item(),
            "angle": scores.angle[mask].mean().item(),
            "planned_angle": scores.planned[mask].mean().item(),
            "executed": executed,
            "skip_rate": 1 - executed / n_sublayers,
            "skip_rate_attn": 1 - scores.executed_attn[mask].mean().item() / (n_sublayers / 2),
            "skip_rate_mlp": 1 - scores.executed_mlp[mask].mean().item() / (n_sublayers / 2),
        })
    return rows


def role_table(scores: TokenScores, roles: dict[str, Tensor], n_sublayers: int) -> list[dict]:
    """One row per role of the task's targets (`Task.roles` of the sequences, (N, T + 1)): its
    name, token count, mean angle and skip rates (all sublayers, attention, MLP) at the positions
    that predict it."""
    scores = scores.flat()
    rows = []
    for name, where in roles.items():
        mask = where[:, 1:].flatten().to(scores.executed.device)
        if not mask.any():
            continue
        rows.append({
            "name": name, "count": int(mask.sum()), "angle": scores.angle[mask].mean().item(),
            "skip_rate": 1 - scores.executed[mask].mean().item() / n_sublayers,
            "skip_rate_attn": 1 - scores.executed_attn[mask].mean().item() / (n_sublayers / 2),
            "skip_rate_mlp": 1 - scores.executed_mlp[mask].mean().item() / (n_sublayers / 2),
        })
    return rows


class DifficultyScores(Metric):
    """The per-token scores of every batch (`update(TokenScores)`), gathered across ranks;
    `compute()` gives the flat names and values validation logs: `<level>/accuracy`, `/loss`,
    `/angle`, `/planned_angle` (when the strategy plans), `/executed`."""

    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for field in fields(TokenScores):
            self.add_state(field.name, default=[], dist_reduce_fx="cat")

    def update(self, scores: TokenScores) -> None:
        for field in fields(TokenScores):
            getattr(self, field.name).append(getattr(scores, field.name).flatten().float())

    def scores(self) -> TokenScores:
        return TokenScores(*(dim_zero_cat(getattr(self, f.name)) for f in fields(TokenScores)))

    def compute(self) -> dict[str, Tensor]:
        values = {}
        for row in level_table(self.scores(), n_sublayers=1):
            for key in ("accuracy", "loss", "angle", "planned_angle", "executed"):
                value = row[key]
                if value is not None and value == value:  # NaN: the strategy plans no angle
                    values[f"{row['name']}/{key}"] = torch.tensor(value, device=self.device)
        return values


@dataclass
class DifficultyReport:
    """`rows`: `level_table` per level; `tokens`: the per-token scores of every target, flat;
    `mod_rate` and `flops_per_token`: the share of (token, sublayer) executions skipped and the
    forward FLOPs per token, over every input token (`nag_lightning.model.flops.count_model`)."""

    rows: list[dict]
    tokens: TokenScores
    mod_rate: float = 0.0
    flops_per_token: float = 0.0


@torch.no_grad()
def evaluate_by_difficulty(model: Transformer, sequences: Labelled, batch_size: int = 32) -> DifficultyReport:
    """Score `model` (as it is set up: its routers decide) on labelled `sequences` (N, T + 1), in
    batches of `batch_size`, by difficulty level."""
    device = next(model.parameters()).device
    parts = []
    n_tokens = skipped = flops = 0.0
    for start in range(0, len(sequences.tokens), batch_size):
        batch = Labelled(sequences.tokens[start:start + batch_size].to(device),
                         sequences.difficulty[start:start + batch_size].to(device))
        parts.append(score_batch(model, batch).flat())
        count = count_model(model, batch.tokens.shape[1] - 1)  # of the forward just run
        n_tokens += count.tokens
        skipped += count.mod_rate * count.tokens
        flops += count.forward
    tokens = TokenScores(*(torch.cat([getattr(p, f.name) for p in parts]).cpu() for f in fields(TokenScores)))
    return DifficultyReport(level_table(tokens, len(model.sublayers)), tokens,
                            mod_rate=skipped / n_tokens, flops_per_token=flops / n_tokens)


@contextmanager
def every_token_runs(model: Transformer) -> Iterator[Transformer]:
    """Within: every routed sublayer runs every token, each writing with the gate its router gives
    (top-k's sigmoid score; 1 for the threshold router). A routed model scored this way shows what
    it learned, apart from what its routing lets it use: the two differ where evaluation's skips
    take an answer's sublayers, and agree where training itself did not learn the skill."""
    routers = [s.router for s in model.sublayers if s.routed]

    def full_depth(decide):
        return lambda *args, **kwargs: Route(gate=decide(*args, **kwargs).gate)

    for router in routers:
        router.forward = full_depth(router.forward)  # an instance attribute: nn.Module calls it
    try:
        yield model
    finally:
        for router in routers:
            del router.forward


def task_sequences(task: str, task_options: dict, n: int, length: int, seed: int) -> Labelled:
    """`n` labelled sequences of `length` tokens of a registered task, from an evaluation seed
    stream of `seed` that training and validation never draw from."""
    from nag_lightning.tasks.datamodule import seeded

    if not TASKS.knows(task):  # a study or checkpoint names tasks by short name only
        raise ValueError(f"Unknown task {task!r}; registered: {', '.join(TASKS.names())}.")
    return build_task(task, **task_options).sample(n, length, seeded(seed, "evaluation"))


def evaluate_checkpoint(ckpt_path: str, sequences: Labelled, batch_size: int = 32, device: str = "cpu",
                        trust_checkpoint: bool = False, every_token: bool = False) -> DifficultyReport:
    """`evaluate_by_difficulty` of a `nag-lightning fit` checkpoint's model, read as untrusted input
    (`nag_lightning.checkpoints.loading`); with `every_token`, at full depth (`every_token_runs`)."""
    from nag_lightning.checkpoints.loading import load_model

    model = load_model(ckpt_path, device, trust_checkpoint).model
    if len(sequences.tokens[0]) - 1 > model.cfg.seq_len:
        raise ValueError(f"The sequences have {len(sequences.tokens[0]) - 1} input tokens, more than the "
                         f"checkpoint's model.arch.seq_len = {model.cfg.seq_len}; give shorter ones.")
    if every_token:
        with every_token_runs(model):
            return evaluate_by_difficulty(model, sequences, batch_size)
    return evaluate_by_difficulty(model, sequences, batch_size)


def spearman(tokens: TokenScores, compute: str = "angle", answers_only: bool = True) -> float:
    """The rank correlation between a compute measure ("angle", "planned" or "executed") and the
    difficulty label, over the answer tokens (labels >= 1) or, with `answers_only` False, over
    every predictable token (labels >= 0). NaN when either side is constant, or the measure is
    absent (NaN: no planned angle)."""
    keep = tokens.difficulty >= (1 if answers_only else 0)
    x, y = getattr(tokens, compute)[keep].double(), tokens.difficulty[keep].double()
    if keep.sum() < 2 or not x.isfinite().all() or x.std() == 0 or y.std() == 0:
        return float("nan")
    return spearman_corrcoef(x, y).item()
