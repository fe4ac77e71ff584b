"""Where a hops model does the work of an answer: skip one sublayer kind at the positions of one
role (`Task.roles`) in every block, and score each level.

    python experiments/role_ablation.py RUN_DIR [RUN_DIR ...] [--kinds mlp attn] [--sequences 128]
    python experiments/role_ablation.py RUN_DIR --per_block answer   # one block's MLP at a time

A run folder is one of `nag-lightning study tasks`. Its checkpoint is read as untrusted input, and
every routed sublayer runs every token (`every_token_runs`), so the ablation alone decides. A row
per (kind, role): accuracy (%) on 1-4 hops with that kind skipped at the positions predicting the
role's tokens; the first row skips nothing. With `--per_block ROLE`, a row per block: its MLP
alone skipped at the positions predicting that role, beside the share of those positions the run's
own router runs it at (routed, as trained), so a router that runs exactly the MLPs an answer needs
shows as high shares where skipping costs most. Causal by construction: a position's skip changes its
own state and what later positions read from it, nothing earlier.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path

import torch

from nag_lightning.analysis.studies.tasks import task_settings
from nag_lightning.checkpoints.loading import load_model
from nag_lightning.routers import Route
from nag_lightning.tasks import build_task
from nag_lightning.tasks.evaluation import evaluate_by_difficulty, every_token_runs, task_sequences


@contextmanager
def skipped_at(model, kind: str, where: torch.Tensor, block: int | None = None):
    """Within: every `kind` sublayer (or block `block`'s alone) skips the input positions `where`
    (N, T) and runs the rest."""
    sublayers = [s for s in model.sublayers if s.kind == kind]
    sublayers = sublayers if block is None else sublayers[block:block + 1]
    before = [(s.router.__dict__.get("forward"), s.router.routes) for s in sublayers]
    for s in sublayers:
        s.router.forward = lambda *args, **kwargs: Route(executed=~where)
        s.router.routes = True
    try:
        yield
    finally:
        for s, (forward, routes) in zip(sublayers, before):
            del s.router.forward
            if forward is not None:
                s.router.forward = forward
            s.router.routes = routes


def routed_share(model, tokens: torch.Tensor, where: torch.Tensor) -> list[float]:
    """Per block, the share of the positions `where` whose MLP the model's own routing runs."""
    model.record_diagnostics(True)
    with torch.no_grad():
        model(tokens)
    model.record_diagnostics(False)
    mlps = [s for s in model.sublayers if s.kind == "mlp"]
    return [1.0 if s.executed is None else s.executed[where].float().mean().item() for s in mlps]


def ablate(run: Path, kinds: list[str], n: int, per_block: str | None = None) -> None:
    task, options, seq_len = task_settings(run / "version_0" / "config.yaml")
    labelled = task_sequences(task, options, n, seq_len + 1, 1000)
    roles = build_task(task, **options).roles(labelled)
    model = load_model(str(run / "version_0" / "checkpoints" / "last.ckpt")).model
    levels = ["k1", "k2", "k3", "k4"]

    def row(label: str) -> None:
        rows = {r["name"]: r for r in evaluate_by_difficulty(model, labelled, batch_size=n).rows}
        cells = " | ".join(f"{100 * rows[k]['accuracy']:.1f}" for k in levels)
        print(f"| {run.name} | {label} | {cells} |")

    if per_block is not None:
        where = roles[per_block][:, 1:]
        shares = routed_share(model, labelled.tokens[:, :-1], where)
        with every_token_runs(model):
            row("nothing")
            for block, share in enumerate(shares):
                with skipped_at(model, "mlp", where, block):
                    row(f"block {block}'s mlp where {per_block} is predicted (routed: runs {share:.0%})")
        return
    with every_token_runs(model):
        row("nothing")
        for kind in kinds:
            for name, mask in roles.items():
                if name == "padding":
                    continue
                # a role names targets; the position that predicts target t + 1 is input t
                with skipped_at(model, kind, mask[:, 1:]):
                    row(f"{kind} at the positions predicting {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--kinds", nargs="+", default=["mlp", "attn"])
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--per_block", default=None, help="a role: skip one block's MLP at a time there")
    args = parser.parse_args()
    print("| run | skipped | 1 hop | 2 hops | 3 hops | 4 hops |\n|---|---|---|---|---|---|")
    for run in args.runs:
        ablate(run, args.kinds, args.sequences, args.per_block)


if __name__ == "__main__":
    main()
