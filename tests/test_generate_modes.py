"""`generate_tokens` routes causally (eval mode, top-k on its predictor) while it runs and gives the
caller's model back as it was: training flags of every module and the routers' eval routing, also
when generation fails."""

from __future__ import annotations

import pytest
import torch

from nag_lightning import Transformer, TransformerConfig
from nag_lightning.analysis.evaluation import generate as generate_module
from nag_lightning.analysis.evaluation.generate import generate_tokens


def topk_model() -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(d_model=16, n_layers=2, n_heads=2, seq_len=16, router="topk",
                            router_options={"capacity": 0.5, "eval_routing": "topk"})
    return Transformer(cfg)


def modes(model: Transformer) -> dict[str, bool]:
    return {name: module.training for name, module in model.named_modules()}


def test_generation_routes_causally_and_restores_modes():
    model = topk_model().train()
    model.blocks[1].eval()  # a mix of modes comes back as it was, not as model.train() would set it
    before = modes(model)
    seen = []
    hook = model.register_forward_hook(lambda m, a, o: seen.append(
        (m.training, {s.router.eval_routing for s in m.sublayers})))
    generate_tokens(model, list(b"def "), 3)
    hook.remove()
    assert seen and all(s == (False, {"predictor"}) for s in seen)  # causal while generating
    assert modes(model) == before
    assert {s.router.eval_routing for s in model.sublayers} == {"topk"}


def test_generation_that_fails_restores_modes(monkeypatch):
    model = topk_model().train()
    before = modes(model)

    def fail(*args, **kwargs):
        raise RuntimeError("sampling failed")

    monkeypatch.setattr(generate_module, "sample", fail)
    with pytest.raises(RuntimeError, match="sampling failed"):
        generate_tokens(model, list(b"def "), 3)
    assert modes(model) == before
    assert {s.router.eval_routing for s in model.sublayers} == {"topk"}
