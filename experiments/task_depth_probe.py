"""A quick loop over a synthetic task: train a `Transformer` on it, then score each difficulty level.

The loop used to choose the settings of the task testbed (docs/results_tasks.md). It is the
LightningModule's training in plain PyTorch (the same AdamW groups, warmup and cosine decay, clip
1.0) without Lightning, so a run costs nothing but the model's own steps. Every run is cached by its
settings under `--out`, so a list of runs resumes where it stopped:

    OMP_NUM_THREADS=1 python experiments/task_depth_probe.py --task state \
        --task_options '{"group": "S3", "max_len": 8}' --residuals prenorm nag --depths 2 8 --seeds 1 2

`--residual_options` sets the residual strategy's options (e.g. NAG's `theta_max`). With `--router`
every sublayer is routed (e.g. `--router threshold --router_options
'{"predictor": "angle", "target_rate": 0.25}'`), and with `--iso_flop` a routed run trains until it has
spent the training FLOPs (the package's exact count, `TransformerFlopCounter`) that the full-depth
model spends in `--steps` steps; its learning-rate schedule then spans the steps that budget buys,
estimated from the first step's count and corrected as the count comes in.

Accuracy is exact match (argmax = next token) on 256 sequences drawn from seed 10000 + the run's
seed (the training batches come from a generator seeded with the run's seed), per level: 0 is
FORMAT, k >= 1 the answers that need k steps; UNPREDICTABLE tokens are not scored. The scores are
taken every `--eval_every` steps; the last are the run's result.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.model.flops import TransformerFlopCounter, reference_training_flops
from nag_lightning.tasks import build_task
from nag_lightning.tasks.evaluation import evaluate_by_difficulty, spearman, task_sequences

try:  # run as a script from experiments/
    from nag_diagnosis import GradientLog, diagnose
except ImportError:
    from experiments.nag_diagnosis import GradientLog, diagnose

EVAL_SEED = 10_000


def optimizer(model: Transformer, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW as `LanguageModel.configure_optimizers` builds it: matrices decay, the rest not."""
    decays = lambda name, p: p.ndim == 2 and not name.startswith(("embed", "strategy"))
    params = list(model.named_parameters())
    return torch.optim.AdamW(
        [{"params": [p for n, p in params if decays(n, p)], "weight_decay": weight_decay},
         {"params": [p for n, p in params if not decays(n, p)], "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95),
    )


def lr_factor(step: int, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Step `step` (from 1) of `total`: linear warmup times a cosine from 1 to min_ratio."""
    cosine = 0.5 * (1 + math.cos(math.pi * min(step / total, 1.0)))
    return min(step / warmup, 1.0) * (min_ratio + (1 - min_ratio) * cosine)


@torch.no_grad()
def score(model: Transformer, task, seq_len: int, seed: int, n: int = 256) -> dict[int, dict]:
    """Accuracy and loss per level on `n` sequences drawn from `seed`."""
    data = task.sample(n, seq_len + 1, torch.Generator().manual_seed(seed))
    model.eval()
    logits = torch.cat([model(data.tokens[i:i + 64, :-1]).logits for i in range(0, n, 64)]).float()
    model.train()
    targets, levels = data.tokens[:, 1:], data.difficulty[:, 1:]
    loss = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    right = logits.argmax(-1) == targets
    return {
        level: {"acc": right[levels == level].float().mean().item(),
                "loss": loss[levels == level].mean().item(), "count": int((levels == level).sum())}
        for level in range(task.max_difficulty + 1) if (levels == level).any()
    }


def train(args: argparse.Namespace, residual: str, depth: int, seed: int) -> dict:
    torch.manual_seed(seed)
    task = build_task(args.task, **json.loads(args.task_options))
    config = TransformerConfig(vocab_size=256, d_model=args.d_model, n_layers=depth, n_heads=args.n_heads,
                               seq_len=args.seq_len, residual=residual,
                               residual_options=json.loads(args.residual_options), router=args.router,
                               router_options=json.loads(args.router_options))
    model = Transformer(config)
    counter = TransformerFlopCounter(model)
    budget = reference_training_flops(config, args.steps * args.batch_size * args.seq_len)
    opt = optimizer(model, args.lr[residual], args.weight_decay)
    batches = torch.Generator().manual_seed(seed)
    history, start, spent, step, total = [], time.time(), 0, 0, args.steps
    gradients = GradientLog(model) if args.diagnose else None
    probe = task.sample(64, args.seq_len + 1, torch.Generator().manual_seed(EVAL_SEED + 1 + seed))
    diagnostics = []
    while step < total:
        step += 1
        for group in opt.param_groups:
            group["lr"] = args.lr[residual] * lr_factor(step, args.warmup, total)
        batch = task.sample(args.batch_size, args.seq_len + 1, batches).tokens
        out = model(batch[:, :-1])
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        (loss + out.aux_loss).backward()
        if gradients is not None:
            gradients(step, loss.item(), out.aux_loss.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        spent += int(counter.step().training)
        if args.iso_flop:  # the steps the budget buys at the mean cost per step so far
            total = max(step + (spent < budget), round(budget / (spent / step)))
        if step % args.eval_every == 0 or step == total:
            levels = score(model, task, args.seq_len, EVAL_SEED + seed)
            history.append({"step": step, "loss": loss.item(),
                            "acc": {k: round(v["acc"], 4) for k, v in levels.items()}})
            if args.diagnose:
                diagnostics.append({"step": step, **diagnose(model, probe.tokens, probe.difficulty)})
            print(f"{residual} L{depth} s{seed} step {step}/{total} loss {loss.item():.3f} "
                  f"{time.time() - start:.0f}s acc {history[-1]['acc']}", flush=True)
    seconds = time.time() - start
    return {"task": task.describe(), "residual": residual, "depth": depth, "seed": seed,
            "lr": args.lr[residual], "steps": step, "seconds": seconds,
            "residual_options": json.loads(args.residual_options), "router": args.router,
            "router_options": json.loads(args.router_options), "iso_flop": args.iso_flop,
            "training_flops": spent,
            "full_depth_training_flops": budget,
            "levels": levels, "history": history, "diagnostics": diagnostics,
            "gradients": [] if gradients is None else gradients.rows,
            **compute_by_difficulty(model, args, seed)}


def compute_by_difficulty(model: Transformer, args: argparse.Namespace, seed: int) -> dict:
    """The package's evaluation by difficulty (`nag_lightning.tasks.evaluation`) on 256 sequences
    of an evaluation stream: per level, the angle summed over sublayers (and NAG's planned angle),
    and the Spearman correlation of that compute with difficulty over the answer tokens and over
    every predictable token."""
    options = json.loads(args.task_options)
    sequences = task_sequences(args.task, options, 256, args.seq_len + 1, EVAL_SEED + seed)
    report = evaluate_by_difficulty(model.eval(), sequences)
    correlations = {
        measure: {"answers": spearman(report.tokens, measure),
                  "predictable": spearman(report.tokens, measure, answers_only=False)}
        for measure in ("angle", "planned", "executed")
    }
    return {"by_level": report.rows, "spearman": correlations}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--task", default="state")
    parser.add_argument("--task_options", default="{}", help="JSON options of the task")
    parser.add_argument("--residuals", nargs="+", default=["prenorm"])
    parser.add_argument("--lrs", default="{}", help='JSON learning rate per residual, e.g. {"nag": 6e-3}')
    parser.add_argument("--depths", nargs="+", type=int, default=[2, 8])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1])
    parser.add_argument("--d_model", type=int, default=64)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate of residuals not in --lrs")
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--eval_every", type=int, default=250)
    parser.add_argument("--residual_options", default="{}", help="JSON options of every residual")
    parser.add_argument("--router", default="none", help="router of every sublayer")
    parser.add_argument("--router_options", default="{}", help="JSON options of the router")
    parser.add_argument("--iso_flop", action="store_true",
                        help="train on the full-depth model's training FLOPs of --steps steps")
    parser.add_argument("--diagnose", action="store_true",
                        help="record per-sublayer angles, direction survival, norms and gradients "
                             "(experiments/nag_diagnosis.py) at every evaluation")
    parser.add_argument("--tag", default="", help="appended to a run's cache name")
    parser.add_argument("--out", default="runs/task_probe")
    parser.add_argument("--table", action="store_true", help="print the cached runs under --out as a table")
    args = parser.parse_args()
    if args.table:
        print(table(Path(args.out)))
        return
    lrs = json.loads(args.lrs)
    args.lr = {r: float(lrs.get(r, args.lr)) for r in args.residuals}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        for depth in args.depths:
            for residual in args.residuals:
                routing = "" if args.residual_options == "{}" else f"-{args.residual_options}"
                routing += "" if args.router == "none" else f"-{args.router}{args.router_options}"
                routing += "-isoflop" if args.iso_flop else ""
                name = (f"{args.task}-{args.task_options}-{residual}-L{depth}-d{args.d_model}-T{args.seq_len}"
                        f"-b{args.batch_size}-n{args.steps}-lr{args.lr[residual]}{routing}{args.tag}-s{seed}")
                path = out / (name.replace(" ", "").replace('"', "").replace("/", "_") + ".json")
                if path.exists():
                    continue
                result = train(args, residual, depth, seed)
                path.write_text(json.dumps(result, indent=1))


def table(out: Path) -> str:
    """One markdown row per cached run: accuracy per level (%), seconds, and the Spearman
    correlations of compute with difficulty where the run recorded them."""
    runs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    runs.sort(key=lambda r: (r["task"], r["residual"], routing(r), r["lr"], r["depth"], r["seed"]))
    levels = sorted({int(k) for r in runs for k in r["levels"]})
    head = ["task", "residual", "router", "lr", "blocks", "seed", "steps", *[f"acc {k}" for k in levels],
            "s", "rho angle", "rho planned", "rho executed"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in runs:
        rho = r.get("spearman", {})
        acc = r["levels"]
        cells = [r["task"], r["residual"], routing(r), f"{r['lr']:g}", str(r["depth"]), str(r["seed"]),
                 str(r["steps"]),
                 *[f"{100 * acc[str(k)]['acc']:.1f}" if str(k) in acc else "" for k in levels],
                 f"{r['seconds']:.0f}",
                 *[f"{rho[m]['answers']:.2f}" if m in rho else "" for m in ("angle", "planned", "executed")]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def routing(run: dict) -> str:
    """The run's residual options, router and router options in a table cell ("none": defaults,
    no router)."""
    cells = [", ".join(f"{k} {v}" for k, v in run.get("residual_options", {}).items())]
    if run.get("router", "none") != "none":
        options = ", ".join(f"{k} {v}" for k, v in run["router_options"].items())
        cells.append(f"{run['router']} ({options})" + (" iso-FLOP" if run.get("iso_flop") else ""))
    return "; ".join(c for c in cells if c) or "none"


if __name__ == "__main__":
    main()
