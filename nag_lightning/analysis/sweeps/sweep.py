"""`nag-lightning sweep`: the accuracy/compute trade-off of a trained model (arXiv 2606.16112,
claim 5: MoD as a post-training knob).

    checkpoint ─> trained without routing: attach the routers the unrouted one offers
                  (threshold; `--router_options '{predictor: angle}'` skips on NAG's gated
                  angle itself), fit their probes, if any, with the model frozen (`probes`)
               ─> trained with a router: its own routers as trained
    then, for every value of the routers' sweep setting (tau in radians, top-k capacity, ...),
    evaluate N validation batches (`analysis.evaluation.checkpoint`): MoD rate, executed forward
    FLOPs per token, loss, bits per byte  ─> sweep.csv, sweep.png (`report`)

The sweep asks routers only through `sweepable.sweep_of`, so a router of another package, named by
class path, that implements `Sweepable` sweeps as the built-in ones do. When the setting is an
angle threshold, the oracle curve skips a sublayer where its *measured* contribution angle is
below it (`oracle`): it knows the angle only after computing the sublayer, so it saves no compute;
for a model trained without a router it bounds from above what a predictor of the angle could
reach at the same MoD rate. A model trained with routing never ran dense, so there it is a
reference, not a bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

import torch
from torch import Tensor

from nag_lightning.analysis.checks import check_at_least_one, check_device, check_not_empty, check_seed
from nag_lightning.analysis.evaluation.checkpoint import checkpoint_data, evaluate, first_batches
from nag_lightning.analysis.sweeps.oracle import oracle as oracle_of
from nag_lightning.analysis.sweeps.probes import attach_sweep_routers, fit_probes
from nag_lightning.analysis.sweeps.report import ORACLE, SweepRow, plot, report, write_csv
from nag_lightning.analysis.sweeps.sweepable import RouterSweep, sweep_of
from nag_lightning.checkpoints.loading import load_model
from nag_lightning.checkpoints.trust import is_remote
from nag_lightning.inputs import output_folder
from nag_lightning.model import SUBLAYER_KINDS, Transformer
from nag_lightning.model.flops import full_depth_forward_flops
from nag_lightning.registry import plugin_name
from nag_lightning.routers import Router


class Trained(Protocol):
    """What the sweep needs of a trained model: the network, and the bytes each token id stands
    for (None: one byte each), which turn its loss into bits per byte."""

    model: Transformer
    token_bytes: Tensor | None


def routed_routers(model: Transformer) -> list[Router]:
    """The routers of the routed sublayers, all of one class (a model has one router setting)."""
    routers = [s.router for s in model.sublayers if s.routed]
    kinds = {type(r) for r in routers}
    if len(kinds) > 1:
        raise ValueError(
            f"The model routes with several router classes ({sorted(k.__name__ for k in kinds)}); "
            "a sweep varies one router's setting, so sweep a model with one router."
        )
    return routers


@torch.no_grad()
def read_inputs(model: Transformer, routers: list[Router], batch: Tensor) -> list[Tensor]:
    """The read input h each of `routers` sees on `batch`."""
    inputs: dict[Router, Tensor] = {}
    hooks = [r.register_forward_hook(lambda router, args, out: inputs.__setitem__(router, args[0]))
             for r in routers]
    try:
        model(batch[:, :-1].to(next(model.parameters()).device))
    finally:
        for hook in hooks:
            hook.remove()
    return [inputs[r] for r in routers]


def run_sweep(
    trained: Trained,
    val_batches: list[Tensor],
    fit_batches: list[Tensor] | None,
    taus: list[float] | None = None,
    capacities: list[float] | None = None,
    route_kinds: list[str] | None = None,
    fit_lr: float = 1e-2,
    oracle: bool = True,
    values: list[float] | None = None,
    router_options: dict | None = None,
) -> list[SweepRow]:
    """Evaluate a trained model (a `LoadedModel` or a `LanguageModel`) over routing settings; see
    the module docstring.
    The values swept are `values`, else `taus` for a setting named tau, `capacities` for one named
    capacity, else the router's defaults (`Sweepable.default_sweep_values`). `router_options` go to
    the routers attached to a model trained without one."""
    model: Transformer = trained.model
    routers, adapter = sweep_routers(model, fit_batches, route_kinds, fit_lr, router_options)
    setting = adapter.setting
    swept = plugin_name(type(routers[0]))
    seq_len = val_batches[0].shape[1] - 1
    dense_flops = full_depth_forward_flops(model.cfg, seq_len) / seq_len
    rows: list[SweepRow] = []

    def add(method: str, value: float) -> None:
        result = evaluate(model, val_batches, token_bytes=trained.token_bytes)
        rows.append(SweepRow(
            method=method, setting=setting, value=value, mod_rate=result["mod_rate"],
            flops_per_token=result["flops_per_token"],
            executed_fraction=result["flops_per_token"] / dense_flops,
            val_loss=result["val_loss"], bpb=result["bpb"],
            predictor_agreement=result["predictor_agreement"], val_batches=len(val_batches),
        ))

    if adapter.baseline is not None:
        add(adapter.baseline, float(getattr(routers[0], setting)))
    for value in sweep_values(model, routers, adapter, val_batches[0], values, taus, capacities):
        with routing_at(adapter, routers, value):
            add(swept, value)
        if oracle and adapter.setting_is_angle:
            with oracle_of(model, value):
                add(ORACLE, value)
    return rows


def sweep_routers(model: Transformer, fit_batches: list[Tensor] | None, route_kinds: list[str] | None = None,
                  fit_lr: float = 1e-2, router_options: dict | None = None
                  ) -> tuple[list[Router], RouterSweep]:
    """The routers a sweep varies and how (`sweepable`): the model's own as trained, or, for a
    model trained without routing, the routers attached in their place (`probes`), their probes (if
    any) fitted on `fit_batches` with the model frozen. The model is left frozen and in eval mode,
    the attached routers included."""
    model.requires_grad_(False).eval()
    routers = routed_routers(model)
    if routers and router_options:
        raise ValueError(
            "router_options set up the routers a sweep attaches to a model trained without one; this "
            "model was trained with its own routers: drop router_options."
        )
    if not routers:
        if not fit_batches:
            raise ValueError("A model trained without a router needs fit batches to fit the probes.")
        attached = attach_sweep_routers(model, route_kinds or list(SUBLAYER_KINDS), len(fit_batches),
                                        router_options)
        if not attached:
            raise ValueError("No sublayer of --route_kinds was given a router to sweep; name attn or mlp.")
        if any(p.numel() for r in attached for p in r.parameters()):  # predictor: angle learns nothing
            fit_probes(model, attached, fit_batches, fit_lr)
        routers = routed_routers(model)
    # A new router is built in training mode, where it runs every token for its warm-up (the fit
    # batches) and keeps adapting: left so when no probe is fitted, the first settings evaluated
    # would skip nothing, or less than their tau asks.
    model.requires_grad_(False).eval()
    return routers, sweepable(type(routers[0]))


def sweep_values(model: Transformer, routers: list[Router], adapter: RouterSweep, batch: Tensor,
                 values: list[float] | None = None, taus: list[float] | None = None,
                 capacities: list[float] | None = None) -> list[float]:
    """The values of the routers' setting to sweep: `values`, else `taus` or `capacities` for a
    setting of that name, else the router's defaults, read from the routers' inputs on `batch`."""
    chosen = values if values is not None else {"tau": taus, "capacity": capacities}.get(adapter.setting)
    if chosen is None:
        chosen = adapter.default_values(routers, read_inputs(model, routers, batch))
    return list(chosen)


@contextmanager
def routing_at(adapter: RouterSweep, routers: list[Router], value: float) -> Iterator[None]:
    """Within: every one of `routers` routes with its swept setting at `value`."""
    with ExitStack() as stack:
        for router in routers:
            stack.enter_context(adapter.sweeping(router, value))
        yield


def sweepable(kind: type[Router]) -> RouterSweep:
    """How the sweep varies the router class `kind`, or one sentence that it cannot."""
    adapter = sweep_of(kind)
    if adapter is None or adapter.setting is None:
        raise ValueError(
            f"The router {plugin_name(kind)!r} cannot be swept: it names no setting to vary after "
            "training (implement nag_lightning.analysis.sweeps.sweepable.Sweepable on it), so sweep a model "
            "trained with another router."
        )
    return adapter


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
    values: list[float] | None = None,
    router_options: dict | None = None,
    own_run: bool = False,
) -> dict[str, Path]:
    """Sweep a checkpoint's routing and write sweep.csv and sweep.png into `out_dir`.

    Args:
        ckpt_path: a .ckpt file written by `nag-lightning fit`, or a folder of `nag-lightning export`.
        out_dir: folder for sweep.csv and sweep.png; None: `sweep-<checkpoint name>` in the run's
            version folder (next to its checkpoints/ folder), or in the current directory for a
            checkpoint given by URL.
        taus: thresholds in radians (router none or threshold); None picks them at quantiles of the
            predicted angles, spanning MoD rates from 0 to about 60%.
        capacities: top-k capacities to sweep (router topk); None: 1.0 down to 0.3.
        val_batches: validation batches every setting is evaluated on.
        fit_batches: training batches the threshold probes are fitted on (router none only).
        fit_lr: Adam learning rate of that fit.
        route_kinds: sublayer kinds threshold routers are attached to (router none only); None: both.
        oracle: also evaluate the oracle that skips on the measured angle (upper bound).
        source: the text to evaluate on; None: the data the checkpoint was trained on (a file the
            checkpoint names is read only with this option or --trust_checkpoint).
        cache_dir: folder of tokenized corpora; None: the checkpoint's (used only with
            --trust_checkpoint, unless it is the default).
        batch_size: sequences per batch; None: the checkpoint's.
        max_bytes: cap on the corpus bytes; None: the checkpoint's.
        device: where to run ("cpu", "cuda").
        seed: seed of the attached probes' initialisation.
        trust_checkpoint: let the checkpoint's residual or router import and call a class path
            outside the registered plugins, and its data settings name the files to read and write;
            only for checkpoints whose origin you trust.
        values: values of the router's setting to sweep, for any sweepable router (its setting);
            None: taus or capacities, else the router's defaults.
        router_options: options of the routers attached to a model trained without one, e.g.
            {predictor: angle}: skip on the angle NAG's gate plans, with no probe to fit (the
            threshold router's options, docs/routing.md). Only for such models.
        own_run: the checkpoint is of a run this package trained for the caller (a study's), whose
            data settings are used as saved; not a command-line option.
    """
    check_sweep_options(val_batches=val_batches, fit_batches=fit_batches, fit_lr=fit_lr, device=device,
                        seed=seed, values=values, taus=taus, capacities=capacities,
                        route_kinds=route_kinds)
    out = output_folder(out_dir if out_dir is not None else default_out_dir(ckpt_path), "--out_dir")
    loaded = load_model(ckpt_path, device, trust_checkpoint)  # the one read and check of the file
    data = checkpoint_data(loaded, trust_checkpoint or own_run, source=source,
                           cache_dir=cache_dir, batch_size=batch_size, max_bytes=max_bytes)
    data.setup("fit")
    val = first_batches(data.val_dataloader(), val_batches)
    trained_routed = any(s.routed for s in loaded.model.sublayers)
    fit = None if trained_routed else first_batches(data.train_dataloader(), fit_batches)
    torch.manual_seed(seed)
    rows = run_sweep(loaded, val, fit, taus, capacities, route_kinds, fit_lr, oracle, values, router_options)
    cfg = loaded.model.cfg
    title = f"{_name(cfg.residual)}, router {_name(cfg.router)}, {len(val)} val batches"
    adapter = sweepable(type(routed_routers(loaded.model)[0]))
    as_trained = () if adapter.baseline is None else (adapter.baseline,)
    return {"csv": write_csv(rows, out / "sweep.csv"),
            "png": plot(rows, out / "sweep.png", title, trained_routed, as_trained, adapter.labels)}


def check_sweep_options(val_batches: int, fit_batches: int, fit_lr: float, device: str, seed: int,
                        **lists: list | None) -> None:
    """One sentence for an option of `sweep` it cannot run with, before the checkpoint is read."""
    check_at_least_one(val_batches=val_batches, fit_batches=fit_batches)
    if not fit_lr > 0:
        raise ValueError(f"--fit_lr={fit_lr} is not a learning rate; give a positive one (e.g. 1e-2).")
    check_not_empty(**lists)
    check_device(device)
    check_seed(seed)


def _name(spec: object) -> str:
    """A plugin setting as a title shows it: the short name, or the class of a class path."""
    return str(spec).rpartition(".")[2]


def default_out_dir(ckpt_path: str) -> Path:
    """`<version folder>/sweep-<checkpoint stem>` for a checkpoint in a run's checkpoints/ folder,
    else `sweep-<stem>` beside the checkpoint: the results stay with the run they describe. A
    checkpoint given by URL has no folder here: `sweep-<stem>` in the current directory."""
    if is_remote(ckpt_path):
        stem = Path(urlparse(ckpt_path).path).stem
        return Path(f"sweep-{stem}" if stem not in ("", ".", "..") else "sweep")
    ckpt = Path(ckpt_path)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
    return run_dir / f"sweep-{ckpt.stem}"


def sweep_command(args: list[str]) -> None:
    """`nag-lightning sweep`: accuracy against executed compute of a checkpoint's routing."""
    from nag_lightning.arguments import flags_named, function_parser

    parser = function_parser(sweep, "nag-lightning sweep", sweep.__doc__.split("\n")[0], skip=("own_run",))
    options = parser.parse_args(args)
    with flags_named(options.as_dict()):  # the data module's errors name data.X; here the flag is --X
        paths = sweep(**options.as_dict())
    report(paths["csv"])
    print(f"wrote {paths['csv']} and {paths['png']}")
