"""bf16 autocast (`trainer.precision: bf16-mixed`): every residual strategy x every router runs
forward and backward with its routed paths, and a Lightning fit in bf16-mixed trains a routed model.

Under autocast the sublayers' matrix products come out in bf16 while the residual state stays in
fp32, so every place that mixes the two (the padded q/k/v buffer of routed attention, the scatter of
the executed tokens' state lanes, the angle buffer, the routers' gates and predictors) must say
which dtype it writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from nag_lightning import RESIDUALS, ROUTERS, Transformer, TransformerConfig
from nag_lightning.model.routing_stats import routing_stats

T = 16
ROOT = Path(__file__).resolve().parents[1]

# Options that make the built-in routers skip tokens from the first pass on; routers registered
# later run with their defaults.
SKIPPING = {"topk": {"capacity": 0.5}, "threshold": {"target_rate": 0.3, "warmup_steps": 0}}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("router", ROUTERS.names())
@pytest.mark.parametrize("residual", RESIDUALS.names())
def test_bf16_autocast_forward_backward(residual, router, training):
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=T, residual=residual,
                            router=router, router_options=SKIPPING.get(router, {}))
    model = Transformer(cfg)
    idx = torch.randint(0, 256, (3, T), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx)  # one training pass first: it sets an adapting threshold for evaluation
    model.train(training)
    dtypes = []
    model.blocks[-1].attn.compute.qkv.register_forward_hook(lambda m, a, o: dtypes.append(o.dtype))
    for _ in range(2):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(idx)
            loss = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())
        (loss + out.aux_loss).backward()
        assert dtypes[-1] == torch.bfloat16  # autocast really ran the projections in bf16
        assert torch.isfinite(out.logits).all() and torch.isfinite(out.aux_loss)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert any(".compute." in name for name in grads)
    assert all(torch.isfinite(g).all() for g in grads.values()), "a gradient is not finite"
    if router in SKIPPING:
        # the routed path (gather, padded attention, scatter) really ran: tokens were skipped
        assert routing_stats(model, T)["mod_rate"] > 0


def test_the_planned_angle_router_skips_under_bf16_autocast():
    """The recommended router (NAG's planned angle, MLPs at 50%) decides on fp32 angles under
    autocast: after a first optimizer step the gates have spread the angles by less than bf16
    resolves, and deciding in bf16 it skipped nothing."""
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=32, n_layers=2, n_heads=2, seq_len=T, residual="nag", router="threshold",
                            router_options={"predictor": "angle", "target_rate": 0.5, "warmup_steps": 0},
                            route_kinds=["mlp"])
    model = Transformer(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (4, T + 1), generator=torch.Generator().manual_seed(1))
    for _ in range(3):  # a step moves the gates off their equal start; then the threshold follows
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(idx[:, :-1])
            loss = F.cross_entropy(out.logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    skipped = [1 - float(s.executed_per_seq.sum()) / (4 * T) for s in model.sublayers if s.kind == "mlp"]
    assert all(0.1 < share < 0.9 for share in skipped), skipped


def test_lightning_fit_in_bf16_mixed_with_a_routed_model(tmp_path, monkeypatch):
    from nag_lightning.cli import run_lightning_cli

    monkeypatch.chdir(tmp_path)
    cli = run_lightning_cli([
        "fit", "--config", str(ROOT / "recipes" / "debug.yaml"),
        f"--data.cache_dir={tmp_path / 'cache'}", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.precision=bf16-mixed", "--trainer.max_steps=4", "--trainer.val_check_interval=2",
        "--trainer.logger=false", "--model.arch.router=threshold",
        "--model.arch.router_options={target_rate: 0.25, warmup_steps: 1}",
    ])
    assert cli.trainer.global_step == 4
    assert cli.trainer.precision == "bf16-mixed"
    metrics = cli.trainer.callback_metrics
    assert torch.isfinite(metrics["train/loss"]) and torch.isfinite(metrics["val/bpb"])
    seq_len = cli.model.model.cfg.seq_len
    assert routing_stats(cli.model.model, seq_len)["mod_rate"] > 0  # the last (validation) pass skipped
