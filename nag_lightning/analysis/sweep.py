"""`nag-lightning sweep`: the accuracy/compute trade-off of a trained model (arXiv 2606.16112,
claim 5: MoD as a post-training knob).

    checkpoint ─> router none:      attach threshold routers, fit their probes (model frozen)
               ─> router threshold: keep its trained probes
               ─> router topk:      its scorer (exact top-k) and its causal predictor
    then, for every setting (tau in radians, or top-k capacity), evaluate N validation batches:
    MoD rate, executed forward FLOPs per token, loss, bits per byte  ─> sweep.csv, sweep.png

The oracle curve skips a sublayer where its *measured* contribution angle is below tau: it knows
the angle only after computing the sublayer, so it saves no compute; for a model trained without
a router it bounds from above what a predictor of the angle could reach at the same MoD rate. A
model trained with routing never ran dense, so there it is a reference, not a bound.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from nag_lightning.analysis.routing_stats import is_routed
from nag_lightning.flops import count_model, full_depth_forward_flops
from nag_lightning.model import Transformer
from nag_lightning.plotting import pyplot, save
from nag_lightning.routers.threshold import ThresholdRouter
from nag_lightning.routers.topk import TopKRouter

DEFAULT_RATE_QUANTILES = (0.0, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6)
DEFAULT_CAPACITIES = (1.0, 0.9, 0.8, 0.75, 0.7, 0.6, 0.5, 0.4, 0.3)


@dataclass
class SweepRow:
    """One evaluated setting.

    Attributes:
        method: "threshold", "oracle", "topk" (exact, non-causal top-k) or "topk_predictor".
        setting: "tau" (radians) or "capacity".
        value: the setting's value.
        mod_rate: skipped (token, sublayer) executions over all of them, whole model.
        flops_per_token: executed forward FLOPs per token (for the oracle: what its skips would
            cost if they were free to find, which they are not).
        executed_fraction: flops_per_token over the full-depth model's.
        val_loss: next-token cross-entropy in nats.
        bpb: bits per byte: the loss summed over the target tokens, in bits, over the bytes they
            stand for (val_loss / ln 2 for a byte-level model).
        predictor_agreement: top-k only: causal predictor's agreement with the exact top-k.
        val_batches: validation batches the setting was evaluated on (the run's own val/bpb
            averaged over its trainer.limit_val_batches, so the full-depth bpb can differ).
    """

    method: str
    setting: str
    value: float
    mod_rate: float
    flops_per_token: float
    executed_fraction: float
    val_loss: float
    bpb: float
    predictor_agreement: float | None = None
    val_batches: int = 0


def _batches(loader: Iterable, n: int) -> list[Tensor]:
    out = []
    for batch in loader:
        out.append(batch.long())
        if len(out) == n:
            break
    if not out:
        raise ValueError("The data module returned no batches; check the data options.")
    return out


@torch.no_grad()
def evaluate(
    model: Transformer,
    batches: list[Tensor],
    oracle_tau: float | None = None,
    token_bytes: Tensor | None = None,
) -> dict:
    """Mean loss, bits per byte, MoD rate, executed FLOPs per token and router agreement over
    `batches`; with `oracle_tau`, the oracle forward instead of the routers. `token_bytes` (the
    bytes each id stands for, `NAGLanguageModel.token_bytes`) turns the loss into bits per byte;
    None: one byte per token."""
    device = next(model.parameters()).device
    nll = tokens = n_bytes = skipped = flops = 0.0
    agreement: list[float] = []
    for batch in batches:
        batch = batch.to(device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        B, T = inputs.shape
        logits = model(inputs).logits if oracle_tau is None else oracle_forward(model, inputs, oracle_tau)
        nll += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum").item()
        tokens += B * T
        n_bytes += B * T if token_bytes is None else token_bytes.to(device)[targets].sum().item()
        executed = sum(s.executed_per_seq.sum().item() for s in model.sublayers)
        skipped += B * T * len(model.sublayers) - executed
        flops += count_model(model, T).forward
        agreement += [
            s.router.stats()["predictor_agreement"] for s in model.sublayers
            if isinstance(s.router, TopKRouter)
        ]
    return {
        "val_loss": nll / tokens,
        "bpb": nll / n_bytes / math.log(2),
        "mod_rate": skipped / (tokens * len(model.sublayers)),
        "flops_per_token": flops / tokens,
        "predictor_agreement": sum(agreement) / len(agreement) if agreement else None,
    }


def oracle_forward(model: Transformer, idx: Tensor, tau: float) -> Tensor:
    """Logits of `model` when each routed sublayer's write is dropped wherever the angle it turns
    the token by, measured after computing it on every token, is below `tau`. Sets each
    sublayer's `executed_per_seq` to the tokens it kept, as a routed forward would."""
    strategy = model.strategy
    state = strategy.init_state(model.embed(idx))
    for s in model.sublayers:
        h = strategy.read(state, s.index).to(s.compute.proj.weight.dtype)
        written, angle = strategy.write(state, s.compute(h), None, s.index, True)
        keep = angle >= tau if is_routed(s) else torch.ones_like(angle, dtype=torch.bool)
        state = tuple(torch.where(keep.unsqueeze(-1) if new.ndim > keep.ndim else keep, new, old)
                      for new, old in zip(written, state))
        s.executed_per_seq = keep.sum(1)
    features, scale = strategy.final(state)
    logits = model.head(features.to(model.head.weight.dtype))
    return logits if scale is None else logits * scale


def attach_threshold_routers(model: Transformer, route_kinds: list[str], warmup: int) -> None:
    """Give every sublayer of `route_kinds` a fresh threshold router that runs every token for
    its first `warmup` training forwards (while its probe is fitted)."""
    for s in model.sublayers:
        if s.kind in route_kinds:
            router = ThresholdRouter(model.cfg.d_model, warmup_steps=warmup)
            s.router = router.to(next(model.parameters()).device)


def fit_probes(model: Transformer, batches: list[Tensor], lr: float) -> list[float]:
    """Train only the threshold routers' probes on `batches`, the model frozen; returns the
    probes' mean-squared error per batch."""
    model.requires_grad_(False).eval()
    routers = [s.router for s in model.sublayers if isinstance(s.router, ThresholdRouter)]
    params = [p for r in routers for p in r.parameters()]
    for p in params:
        p.requires_grad_(True)
    for r in routers:
        r.train()
    optimizer = torch.optim.Adam(params, lr=lr)
    device = params[0].device
    losses = []
    for batch in batches:
        out = model(batch[:, :-1].to(device))
        optimizer.zero_grad()
        out.aux_loss.backward()
        optimizer.step()
        losses.append(out.aux_loss.item() / len(routers))
    model.requires_grad_(False).eval()
    return losses


@torch.no_grad()
def default_taus(model: Transformer, batches: list[Tensor]) -> list[float]:
    """Thresholds at quantiles of the probes' predicted angles, pooled over routed sublayers, so
    the sweep spans MoD rates from 0 to about 60%."""
    device = next(model.parameters()).device
    predictions: list[Tensor] = []
    hooks = [
        s.router.register_forward_hook(
            lambda router, args, out: predictions.append(router.predict(args[0]).flatten().float())
        )
        for s in model.sublayers if isinstance(s.router, ThresholdRouter)
    ]
    try:
        model(batches[0][:, :-1].to(device))
    finally:
        for hook in hooks:
            hook.remove()
    pooled = torch.cat(predictions).cpu()
    taus = torch.quantile(pooled, torch.tensor(DEFAULT_RATE_QUANTILES, dtype=pooled.dtype))
    taus[0] = 0.0
    return sorted({round(t, 6) for t in taus.tolist()})


def set_tau(model: Transformer, tau: float) -> None:
    for s in model.sublayers:
        if isinstance(s.router, ThresholdRouter):
            s.router.tau.fill_(tau)


def run_sweep(
    module,
    val_batches: list[Tensor],
    fit_batches: list[Tensor] | None,
    taus: list[float] | None = None,
    capacities: list[float] | None = None,
    route_kinds: list[str] | None = None,
    fit_lr: float = 1e-2,
    oracle: bool = True,
) -> list[SweepRow]:
    """Evaluate a trained `NAGLanguageModel` over routing settings; see the module docstring."""
    model: Transformer = module.model
    model.requires_grad_(False).eval()
    router = module.hparams.router
    name = router if isinstance(router, str) else None
    seq_len = val_batches[0].shape[1] - 1
    dense_flops = _dense_flops(model, seq_len)
    rows: list[SweepRow] = []

    def score(model: Transformer, batches: list[Tensor], oracle_tau: float | None = None) -> dict:
        return evaluate(model, batches, oracle_tau, token_bytes=module.token_bytes)

    def add(method: str, setting: str, value: float, result: dict) -> None:
        rows.append(SweepRow(
            method=method, setting=setting, value=value, mod_rate=result["mod_rate"],
            flops_per_token=result["flops_per_token"],
            executed_fraction=result["flops_per_token"] / dense_flops,
            val_loss=result["val_loss"], bpb=result["bpb"],
            predictor_agreement=result["predictor_agreement"], val_batches=len(val_batches),
        ))

    if name == "topk":
        routers = [s.router for s in model.sublayers if isinstance(s.router, TopKRouter)]
        trained = routers[0].capacity
        add("topk_predictor", "capacity", trained, score(model, val_batches))
        for capacity in capacities or DEFAULT_CAPACITIES:
            for r in routers:
                r.capacity, r.eval_routing = capacity, "topk"
            add("topk", "capacity", capacity, score(model, val_batches))
        for r in routers:
            r.capacity, r.eval_routing = trained, "predictor"
        return rows
    if name == "none":
        if not fit_batches:
            raise ValueError("A model trained without a router needs fit batches to fit the probes.")
        attach_threshold_routers(model, route_kinds or ["attn", "mlp"], warmup=len(fit_batches))
        fit_probes(model, fit_batches, fit_lr)
    elif name != "threshold":
        raise ValueError(
            f"sweep handles checkpoints trained with router none, threshold or topk; this one used "
            f"{router!r}."
        )
    for tau in taus if taus is not None else default_taus(model, val_batches):
        if tau < 0:
            raise ValueError(f"A threshold tau is an angle in radians and cannot be negative; got {tau}.")
        set_tau(model, tau)
        add("threshold", "tau", tau, score(model, val_batches))
        if oracle:
            add("oracle", "tau", tau, score(model, val_batches, oracle_tau=tau))
    return rows


def _dense_flops(model: Transformer, seq_len: int) -> float:
    """Forward FLOPs per token of the same model with every token running every sublayer."""
    return full_depth_forward_flops(model.cfg, seq_len) / seq_len


def write_csv(rows: list[SweepRow], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in asdict(row).items()})
    return path


LABELS = {
    "threshold": "threshold router (sweep of tau)",
    "oracle": "oracle: skips on the measured angle (upper bound, saves no compute)",
    "topk": "top-k, exact (non-causal, analysis only)",
    "topk_predictor": "top-k, causal predictor (as trained)",
}


ORACLE_TRAINED_ROUTED = "oracle: skips on the measured angle (saves no compute; no bound here)"


def plot(rows: list[SweepRow], path: Path, title: str, trained_routed: bool = False) -> Path:
    """Bits per byte against executed forward FLOPs per token, one line per method. The oracle
    bounds post-training routing; a model trained with routing never ran dense, so there it is
    only a reference (`trained_routed` says so in its label)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method, style in (("threshold", "o-"), ("oracle", "s--"), ("topk", "o-"),
                          ("topk_predictor", "*")):
        points = sorted((r.flops_per_token, r.bpb, r.mod_rate) for r in rows if r.method == method)
        if not points:
            continue
        x, y, rate = zip(*points)
        label = ORACLE_TRAINED_ROUTED if method == "oracle" and trained_routed else LABELS[method]
        ax.plot(x, y, style, label=label, markersize=9 if style == "*" else 5)
        if method in ("threshold", "topk"):
            for xi, yi, ri in zip(x, y, rate):
                ax.annotate(f"{100 * ri:.0f}%", (xi, yi), fontsize=7, xytext=(3, 3),
                            textcoords="offset points")
    ax.set(xlabel="executed forward FLOPs per token", ylabel="validation bits per byte",
           title=f"{title} (labels: MoD rate)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, path)


def sweep(
    ckpt_path: str,
    out_dir: str | None = None,
    taus: list[float] | None = None,
    capacities: list[float] | None = None,
    val_batches: int = 8,
    fit_batches: int = 32,
    fit_lr: float = 1e-2,
    route_kinds: list[str] | None = None,
    oracle: bool = True,
    source: str | list[str] | None = None,
    cache_dir: str | None = None,
    batch_size: int | None = None,
    max_bytes: int | None = None,
    device: str = "cpu",
    seed: int = 0,
    trust_checkpoint: bool = False,
) -> dict[str, Path]:
    """Sweep a checkpoint's routing and write sweep.csv and sweep.png into `out_dir`.

    Args:
        ckpt_path: a .ckpt file written by `nag-lightning fit`.
        out_dir: folder for sweep.csv and sweep.png; None: `sweep-<checkpoint name>` in the run's
            version folder (next to its checkpoints/ folder).
        taus: thresholds in radians (router none or threshold); None picks them at quantiles of the
            predicted angles, spanning MoD rates from 0 to about 60%.
        capacities: top-k capacities to sweep (router topk); None: 1.0 down to 0.3.
        val_batches: validation batches every setting is evaluated on.
        fit_batches: training batches the threshold probes are fitted on (router none only).
        fit_lr: Adam learning rate of that fit.
        route_kinds: sublayer kinds threshold routers are attached to (router none only); None: both.
        oracle: also evaluate the oracle that skips on the measured angle (upper bound).
        source: the text to evaluate on; None: the data the checkpoint was trained on.
        cache_dir: folder of tokenized corpora; None: the checkpoint's.
        batch_size: sequences per batch; None: the checkpoint's.
        max_bytes: cap on the corpus bytes; None: the checkpoint's.
        device: where to run ("cpu", "cuda").
        seed: seed of the attached probes' initialisation.
        trust_checkpoint: let the checkpoint's residual or router import and call a class path
            outside the registered plugins; only for checkpoints whose origin you trust.
    """
    from nag_lightning.module import NAGLanguageModel
    from nag_lightning.trust import read_checkpoint

    module = load_checkpoint(NAGLanguageModel, ckpt_path, device, trust_checkpoint)
    saved = read_checkpoint(ckpt_path).get("datamodule_hyper_parameters", {})
    data_options = {k: v for k, v in saved.items()
                    if k in ("source", "cache_dir", "batch_size", "max_bytes", "val_fraction", "tokenizer")}
    overrides = {"source": source, "cache_dir": cache_dir, "batch_size": batch_size, "max_bytes": max_bytes}
    data_options.update({k: v for k, v in overrides.items() if v is not None})
    data = checkpoint_data(module, ckpt_path, seq_len=module.hparams.seq_len, **data_options)
    data.prepare_data()
    data.setup("fit")
    val = _batches(data.val_dataloader(), val_batches)
    needs_fit = module.hparams.router == "none"
    fit = _batches(data.train_dataloader(), fit_batches) if needs_fit else None
    torch.manual_seed(seed)
    rows = run_sweep(module, val, fit, taus, capacities, route_kinds, fit_lr, oracle)
    out = Path(out_dir) if out_dir is not None else default_out_dir(ckpt_path)
    title = f"{module.hparams.residual}, router {module.hparams.router}, {len(val)} val batches"
    trained_routed = module.hparams.router != "none"
    return {"csv": write_csv(rows, out / "sweep.csv"),
            "png": plot(rows, out / "sweep.png", title, trained_routed)}


def checkpoint_data(module, ckpt_path: str, **options):
    """A `ByteDataModule` of `options` whose tokens are those `module` (loaded from `ckpt_path`)
    was trained on; one sentence if its tokenizer differs from the checkpoint's."""
    from nag_lightning.data import ByteDataModule

    data = ByteDataModule(**options)
    if data.tokenizer != module.tokenizer:
        raise ValueError(
            f"The checkpoint {ckpt_path} was trained on tokens of {module.tokenizer.describe()}, "
            f"but its data would now be tokenized with {data.tokenizer.describe()}; give the "
            "source and cache_dir it was trained with."
        )
    return data


def default_out_dir(ckpt_path: str) -> Path:
    """`<version folder>/sweep-<checkpoint stem>` for a checkpoint in a run's checkpoints/ folder,
    else `sweep-<stem>` beside the checkpoint: the results stay with the run they describe."""
    ckpt = Path(ckpt_path)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run_dir / f"sweep-{ckpt.stem}"


def load_checkpoint(cls, ckpt_path: str, device: str, trust_checkpoint: bool = False):
    """`cls` (a NAGLanguageModel) from a checkpoint, read as untrusted input (`nag_lightning.trust`)."""
    module = cls.load_from_checkpoint(ckpt_path, map_location=device, trust_checkpoint=trust_checkpoint)
    return module.to(device).eval()


def sweep_command(args: list[str]) -> None:
    """`nag-lightning sweep`: accuracy against executed compute of a checkpoint's routing."""
    from jsonargparse import ArgumentParser

    from nag_lightning.cli import flags_named

    parser = ArgumentParser(prog="nag-lightning sweep", description=sweep.__doc__.split("\n")[0])
    parser.add_function_arguments(sweep)
    options = parser.parse_args(args).as_dict()
    with flags_named(options):  # the data module's errors name data.X; here the flag is --X
        paths = sweep(**options)
    rows = list(csv.DictReader(open(paths["csv"])))
    for row in rows:
        print(f"{row['method']:>15} {row['setting']}={float(row['value']):.4g}  "
              f"MoD {100 * float(row['mod_rate']):5.1f}%  "
              f"FLOPs/token {float(row['flops_per_token']):.4g}  bpb {float(row['bpb']):.4f} "
              f"({row['val_batches']} val batches)"
              + (f"  agreement {float(row['predictor_agreement']):.3f}"
                 if row["predictor_agreement"] else ""))
    print(f"bits per byte over {rows[0]['val_batches']} validation batches (--val_batches); the run's "
          "own val/bpb averaged over its trainer.limit_val_batches, so full depth can differ from it")
    print(f"wrote {paths['csv']} and {paths['png']}")
