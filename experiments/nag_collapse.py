"""Why deep NAG stalled with theta_max = pi/2: a short training probe with a collapse measure.

    OMP_NUM_THREADS=1 python experiments/nag_collapse.py --n-layers 16 --residual nag \
        --options '{"theta_max": 1.5707963}'
    OMP_NUM_THREADS=1 python experiments/nag_collapse.py --n-layers 16 --residual prenorm

Trains one model for `--steps` AdamW steps (lr 3e-3, 30 warmup steps, clip 1.0, no weight decay;
the optimizer and schedule of `nag_lightning.training.optim`)
on the first training batches of the default corpus, printing the training bits per byte every 25
steps. At the end it prints, after each block, the *coherence* of the token directions on a
held-out batch: the norm of the mean of the tokens' unit state vectors (0 when directions are
spread, 1 when every token points the same way). A collapsed stream has coherence 1: nothing in the
state tells tokens apart any more, and the loss stays at the unigram level (about 4.6 bits).
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from nag_lightning import Transformer, TransformerConfig
from nag_lightning.data import TextDataModule
from nag_lightning.training.optim import adamw, lr_factor


def batches(count: int, seq_len: int, batch_size: int, cache_dir: str) -> list[torch.Tensor]:
    data = TextDataModule(seq_len=seq_len, batch_size=batch_size, cache_dir=cache_dir)
    data.prepare_data()
    data.setup()
    out = []
    for batch in data.train_dataloader():
        out.append(batch)
        if len(out) == count:
            return out
    raise ValueError(f"The corpus gave only {len(out)} batches; lower --steps.")


def coherence(model: Transformer, idx: torch.Tensor) -> list[float]:
    """Norm of the mean unit state direction after the embedding and after each block."""

    def measure(state) -> float:
        x = state[0].float().flatten(0, 1)
        return F.normalize(x, dim=-1).mean(0).norm().item()

    with torch.no_grad():
        state = model.strategy.init_state(model.embed(idx))
        values = [measure(state)]
        for block in model.blocks:
            state = block(state, model.strategy)
            values.append(measure(state))
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--residual", default="nag")
    parser.add_argument("--options", default="{}", help="residual_options as JSON")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache-dir", default="data_cache")
    args = parser.parse_args()

    data = batches(args.steps + 1, seq_len=128, batch_size=16, cache_dir=args.cache_dir)
    torch.manual_seed(args.seed)
    cfg = TransformerConfig(d_model=args.d_model, n_layers=args.n_layers, n_heads=4, seq_len=128,
                            residual=args.residual, residual_options=json.loads(args.options))
    model = Transformer(cfg)
    # The package's AdamW groups (no decay here) and its schedule: 30 warmup steps, then constant.
    optimizer = adamw(model, 3e-3, betas=(0.9, 0.999), weight_decay=0.0)
    curve = []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = 3e-3 * lr_factor("cosine", step, 30, args.steps, step / args.steps, 1.0, 1.0)
        batch = data[step]
        loss = F.cross_entropy(model(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 25 == 24:
            curve.append(round(loss.item() / math.log(2), 2))
    print(json.dumps({
        "residual": args.residual, "options": json.loads(args.options), "d_model": args.d_model,
        "n_layers": args.n_layers, "train_bpb_every_25_steps": curve,
        "coherence_after_each_block": [round(c, 3) for c in coherence(model, data[-1][:, :-1])],
    }))


if __name__ == "__main__":
    main()
