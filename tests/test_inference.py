"""Generation with a KV cache against the full forward pass and the uncached reference, for every
registered residual strategy x router (a new plugin is covered the moment it is registered)."""

from __future__ import annotations

import pytest
import torch

from nag_lightning import RESIDUALS, ROUTERS, Transformer, TransformerConfig
from nag_lightning.analysis.evaluation.generate import generate_tokens, use_causal_routing
from nag_lightning.model.inference import CachedDecoder, Sampling, generate_cached, sample
from nag_lightning.routers.threshold import ThresholdRouter

pytestmark = pytest.mark.usefixtures("one_thread")
PLUGINS = [(r, o) for r in RESIDUALS.names() for o in ROUTERS.names()]


def tiny(residual: str, router: str, seq_len: int = 64, calibrate: torch.Tensor | None = None) -> Transformer:
    """A random tiny model in causal eval mode. Threshold routers get tau at the median of their
    predicted angles on `calibrate`, so about half of the tokens skip each sublayer."""
    torch.manual_seed(0)
    # init_std pinned: a random model's routing decisions can sit within rounding of their
    # threshold (a top-k predictor score of 7e-9 with the default init and this seed), where a
    # batched and an incremental pass may round either way; this init keeps them clear of ties.
    model = Transformer(TransformerConfig(
        d_model=32, n_layers=2, n_heads=4, seq_len=seq_len, residual=residual, router=router,
        init_std=0.02,
    ))
    use_causal_routing(model)
    if calibrate is not None:
        predicted = {}
        hooks = [s.router.register_forward_hook(
            lambda r, args, out: predicted.__setitem__(r, r.predict(args[0]).median()))
            for s in model.sublayers if isinstance(s.router, ThresholdRouter)]
        with torch.no_grad():
            model(calibrate)
        for hook in hooks:
            hook.remove()
        for router_module, tau in predicted.items():
            router_module.tau.fill_(float(tau))
    return model


def full_routes(model: Transformer, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of the full forward pass and each sublayer's executed tokens (B, T)."""
    executed = []
    hooks = [s.router.register_forward_hook(
        lambda r, a, route: executed.append(torch.ones(idx.shape, dtype=torch.bool)
                                            if route.executed is None else route.executed))
        for s in model.sublayers]
    with torch.no_grad():
        logits = model(idx).logits
    for hook in hooks:
        hook.remove()
    return logits, executed


def assert_cached_decoding_matches(model: Transformer, idx: torch.Tensor, logits: torch.Tensor) -> None:
    """Cached decoding of `idx` (B, T): a 5-token prompt, then one token at a time, gives the full
    forward's `logits` at every position."""
    decoder = CachedDecoder(model, idx.shape[0])
    step = decoder.extend([row[:5].tolist() for row in idx])
    torch.testing.assert_close(step.logits, logits[:, 4], atol=1e-5, rtol=0)
    for t in range(5, idx.shape[1]):
        step = decoder.extend([[int(row[t])] for row in idx])
        torch.testing.assert_close(step.logits, logits[:, t], atol=1e-5, rtol=0)


@pytest.mark.parametrize(("residual", "router"), PLUGINS)
def test_cached_passes_give_the_full_forward_logits_routes_and_cache(residual, router):
    idx = torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))
    model = tiny(residual, router, calibrate=idx)
    logits, executed = full_routes(model, idx)
    per_position = torch.stack(executed).sum(0)  # (B, T) sublayers run at each position

    # prompts of different lengths in one right-padded prefill, then one token at a time, with
    # rows that have nothing new in some steps
    decoder = CachedDecoder(model, 3)
    done = [12, 25, 1]
    step = decoder.extend([idx[b, :done[b]].tolist() for b in range(3)])
    for b in range(3):
        torch.testing.assert_close(step.logits[b], logits[b, done[b] - 1], atol=1e-5, rtol=0)
        assert step.executed[b, done[b] - 1] == per_position[b, done[b] - 1]
        assert step.executed[b, done[b]:].sum() == 0  # padding runs nothing
    while min(done) < 40:
        chunks = [[int(idx[b, done[b]])] if done[b] < 40 and (b != 1 or done[0] % 3) else []
                  for b in range(3)]
        step = decoder.extend(chunks)
        for b in range(3):
            if chunks[b]:
                torch.testing.assert_close(step.logits[b], logits[b, done[b]], atol=1e-5, rtol=0)
                assert step.executed[b, 0] == per_position[b, done[b]]
                done[b] += 1
            else:
                assert not step.logits[b].any()

    # each attention sublayer cached exactly the tokens that executed it
    attention = [i for i, s in enumerate(model.sublayers) if s.kind == "attn"]
    for i in attention:
        assert decoder.caches[i].length.tolist() == executed[i].sum(1).tolist()
    entries = sum(int(executed[i].sum()) for i in attention)
    sizes = decoder.cache_bytes()
    assert sizes["live"] == entries * 2 * 32 * 4
    assert sizes["unrouted"] == 3 * 40 * len(attention) * 2 * 32 * 4
    assert sizes["allocated"] >= sizes["live"]
    if router in ("threshold", "topk"):  # these routers skip here, so the cache is smaller
        assert sizes["live"] < 0.8 * sizes["unrouted"]


@pytest.mark.parametrize(("residual", "router"), PLUGINS)
def test_cached_greedy_generation_of_500_bytes_is_what_the_uncached_model_computes(residual, router):
    # The uncached reference recomputes the prefix for every byte, so by causality its greedy
    # bytes and routes are the argmax and routes of one forward pass over the finished text.
    # (The test below runs the reference loop itself.)
    prompt = list(b"def main(args):\n    ")
    model = tiny(residual, router, seq_len=len(prompt) + 500,
                 calibrate=torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2)))
    (cached,), _ = generate_cached(model, [prompt], 500)
    assert len(cached.tokens) == 500
    text = torch.tensor(prompt + cached.tokens[:-1]).unsqueeze(0)
    logits, executed = full_routes(model, text)
    start = len(prompt) - 1
    assert logits[0, start:].argmax(-1).tolist() == cached.tokens
    assert torch.stack(executed).sum(0)[0, start:].tolist() == cached.executed
    assert not model.training


@pytest.mark.parametrize(("residual", "router"), [
    pytest.param(*p, marks=() if n == 100 else pytest.mark.slow) for n in (100, 500) for p in PLUGINS
])
def test_cached_greedy_generation_equals_the_uncached_reference(residual, router, request):
    n = 500 if request.node.get_closest_marker("slow") else 100
    prompt = list(b"def main(args):\n    ")
    model = tiny(residual, router, seq_len=len(prompt) + n,
                 calibrate=torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2)))
    reference, reference_executed = generate_tokens(model, prompt, n)
    (cached,), _ = generate_cached(model, [prompt], n)
    assert cached.tokens == reference
    assert cached.executed == reference_executed


def test_batched_prompts_continue_as_they_would_alone_and_sampling_matches_the_reference():
    model = tiny("nag", "threshold", calibrate=torch.randint(0, 256, (2, 32)))
    prompts = [list(b"import os\n"), list(b"x"), list(b"class Tree:\n    def ")]
    sampling = Sampling(temperature=1.0, top_k=50, top_p=0.9, seed=7)
    batch, _ = generate_cached(model, prompts, 30, sampling)
    for i, prompt in enumerate(prompts):
        (alone,), _ = generate_cached(model, [prompt], 30, Sampling(1.0, 50, 0.9, seed=7 + i))
        assert batch[i].tokens == alone.tokens and batch[i].executed == alone.executed
        reference, _ = generate_tokens(model, prompt, 30, 1.0, 50, seed=7 + i, top_p=0.9)
        assert alone.tokens == reference
    assert len({bytes(c.tokens) for c in batch}) == 3


def test_generation_longer_than_seq_len_rebuilds_the_window_from_its_last_half():
    seq_len, keep = 16, 8
    model = tiny("nag", "topk", seq_len=seq_len)
    prompt = list(range(65, 65 + 20))  # longer than seq_len: its last 16 bytes are the context
    (cached,), _ = generate_cached(model, [prompt], 40)

    # the documented rule, by full forward passes: the context grows to seq_len bytes, then
    # restarts from the last seq_len // 2 bytes
    text, start, expected = list(prompt), len(prompt) - seq_len, []
    with torch.no_grad():
        for _ in range(40):
            context = torch.tensor(text[start:]).unsqueeze(0)
            expected.append(int(model(context).logits[0, -1].argmax()))
            text.append(expected[-1])
            if len(text) - start > seq_len:
                start = len(text) - keep
    assert cached.tokens == expected

    decoder = CachedDecoder(model, 1)
    decoder.extend([prompt[:seq_len]])
    with pytest.raises(ValueError, match="more than model.arch.seq_len = 16"):
        decoder.extend([[1]])


@pytest.mark.parametrize("cache", [True, False])
def test_a_stop_string_ends_the_continuation_and_is_kept(cache):
    model = tiny("prenorm", "none")
    prompt = list(b"for i in ")
    (free,), _ = generate_cached(model, [prompt], 40)
    stop = bytes(free.tokens[6:8])
    end = bytes(free.tokens).find(stop) + len(stop)
    if cache:
        (out,), _ = generate_cached(model, [prompt], 40, stop=stop)
        tokens, stopped = out.tokens, out.stopped
    else:
        tokens, _ = generate_tokens(model, prompt, 40, stop=stop)
        stopped = None
    assert tokens == free.tokens[:end]
    assert stopped in (True, None)


def test_sampling_options():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]).clamp_min(1e-30)).repeat(200, 1)
    g = [torch.Generator().manual_seed(i) for i in range(200)]
    assert set(sample(logits, Sampling(1.0, top_p=0.6), g)) == {0, 1}  # nucleus: 0.5 + 0.3
    assert set(sample(logits, Sampling(1.0, top_p=0.5), g)) == {0}
    assert set(sample(logits, Sampling(1.0, top_k=2), g)) == {0, 1}
    assert set(sample(logits, Sampling(1.0), g)) == {0, 1, 2}  # never the byte of probability 0
    assert sample(logits[:1], Sampling(0.0), g[:1]) == [0]
    for bad in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match="top_p <= 1"):
            Sampling(**bad)


def test_cached_generation_refuses_what_it_cannot_do():
    model = tiny("nag", "topk")
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_cached(model, [[1], []], 4)
    with pytest.raises(ValueError, match="stop string is empty"):
        generate_cached(model, [[1]], 4, stop=b"")
    for s in model.sublayers:
        s.router.eval_routing = "topk"  # the exact top-k reads the whole sequence
    with pytest.raises(ValueError, match="eval_routing='predictor'"):
        generate_cached(model, [[1]], 4)
    model.train()
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        CachedDecoder(model, 1)
