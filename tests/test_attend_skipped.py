"""`attend_skipped`: tokens that skip a routed attention sublayer still offer their key and value.
The attention of the executed tokens equals dense attention at their positions, generation with
the KV cache computes what the full forward does, and the FLOP count matches FlopCounterMode."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from nag_lightning import Transformer, TransformerConfig
from nag_lightning.analysis.evaluation.generate import use_causal_routing
from nag_lightning.model.flops import count_model
from nag_lightning.model.inference import CachedDecoder
from nag_lightning.routers.threshold import ThresholdRouter
from tests.test_flops import UNEVEN, T
from tests.test_flops import tiny as tiny_for_flops
from tests.test_inference import full_routes

pytestmark = pytest.mark.usefixtures("one_thread")


def attention(seq_len: int = 10) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=16, n_layers=1, n_heads=2, seq_len=seq_len,
                                          router="topk", attend_skipped=True))
    return model.blocks[0].attn.compute, torch.randn(3, seq_len, 16)


def test_executed_queries_see_every_earlier_token_as_dense_attention_does():
    attn, h = attention()
    dense = attn(h)  # every token, causal
    at = torch.tensor([[0, 3, 4, 9], [1, 2, 5, 6], [2, 7, 8, 9]])  # increasing, like top-k's
    expected = dense.gather(1, at[..., None].expand(-1, -1, 16))
    torch.testing.assert_close(attn.forward_every_key(h, at), expected)
    executed = torch.zeros(3, 10, dtype=torch.bool)
    executed[0, [0, 5]] = True  # uneven counts: padding slots that must not leak
    executed[1, [1, 2, 3, 8, 9]] = True
    executed[2, 4] = True
    b, t = executed.nonzero(as_tuple=True)
    torch.testing.assert_close(attn.forward_every_key_masked(h, b, t, executed), dense[b, t])


def test_a_skipped_token_is_read_only_under_attend_skipped():
    """Token 2 skips the only (routed) attention sublayer; changing its input changes what later
    executed tokens read from it only when skipped tokens offer keys."""
    for attend_skipped, changes in ((True, True), (False, False)):
        torch.manual_seed(0)
        model = Transformer(TransformerConfig(
            d_model=16, n_layers=1, n_heads=2, seq_len=8, router="tests.test_flops.UnevenRouter",
            route_kinds=["attn"], attend_skipped=attend_skipped)).eval()
        idx = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])  # sequence 0 runs positions 0, 2, 4, 6
        other = idx.clone()
        other[0, 1] = 200  # position 1 skips attention
        with torch.no_grad():
            a, b = model(idx).logits, model(other).logits
        assert torch.allclose(a[0, 2:], b[0, 2:]) != changes


def tiny_with_every_key(router: str, calibrate: torch.Tensor) -> Transformer:
    """The generation tests' tiny model (causal routing, init pinned), with attend_skipped;
    threshold routers' tau at the median of their predictions on `calibrate`."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(d_model=32, n_layers=2, n_heads=4, seq_len=64, residual="nag",
                                          router=router, init_std=0.02, attend_skipped=True))
    use_causal_routing(model)
    for sublayer in model.sublayers:
        if isinstance(sublayer.router, ThresholdRouter):
            seen = []
            hook = sublayer.router.register_forward_hook(
                lambda r, args, out, seen=seen: seen.append(r.predict(args[0]).median()))
            with torch.no_grad():
                model(calibrate)
            hook.remove()
            sublayer.router.tau.fill_(float(seen[0]))
    return model


@pytest.mark.parametrize("router", ["threshold", "topk"])
def test_cached_generation_computes_the_full_forward(router):
    idx = torch.randint(0, 256, (3, 30), generator=torch.Generator().manual_seed(1))
    model = tiny_with_every_key(router, idx)
    logits, executed = full_routes(model, idx)
    assert any(not e.all() for e in executed)  # tokens really skip
    decoder = CachedDecoder(model, 3)
    done = [7, 16, 1]  # right-padded prefill, then a token at a time
    step = decoder.extend([idx[b, :done[b]].tolist() for b in range(3)])
    for b in range(3):
        torch.testing.assert_close(step.logits[b], logits[b, done[b] - 1], atol=1e-5, rtol=0)
    while min(done) < 30:
        chunks = [[int(idx[b, done[b]])] if done[b] < 30 else [] for b in range(3)]
        step = decoder.extend(chunks)
        for b in range(3):
            if chunks[b]:
                torch.testing.assert_close(step.logits[b], logits[b, done[b]], atol=1e-5, rtol=0)
                done[b] += 1
    for i, sublayer in enumerate(model.sublayers):  # every token is a key of every attention
        if sublayer.kind == "attn":
            assert decoder.caches[i].length.tolist() == [30, 30, 30]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("router", ["topk", UNEVEN])
def test_flop_count_matches_flop_counter_mode(router, training):
    options = {"capacity": 0.5} if router == "topk" else {}
    model = tiny_for_flops("nag", router, router_options=options, attend_skipped=True)
    idx = torch.randint(0, 256, (3, T))
    model(idx)
    model.train(training)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(idx)
    counted = count_model(model, T)
    assert counted.mod_rate > 0
    assert counted.forward == counter.get_total_flops()
    plain = tiny_for_flops("nag", router, router_options=options)
    plain(idx)
    plain.train(training)(idx)
    extra = count_model(plain, T)  # the same routes without skipped keys cost less
    assert counted.forward > extra.forward


@pytest.mark.parametrize("router", ["topk", "threshold"])
def test_compiled_losses_and_gradients_follow_eager(router, monkeypatch):
    import tests.test_compile as compile_tests

    def tiny(residual: str, router: str = "none", n_layers: int = 1) -> Transformer:
        torch.manual_seed(0)
        return Transformer(TransformerConfig(
            d_model=16, n_layers=n_layers, n_heads=2, seq_len=16, residual=residual, router=router,
            router_options=compile_tests.ROUTERS[router], attend_skipped=True))

    monkeypatch.setattr(compile_tests, "tiny", tiny)
    compile_tests.losses_and_gradients_agree("nag", router, "aot_eager")
