"""Generation with a KV cache: every token is computed once, and a token that skips a sublayer
costs that sublayer nothing. Plain torch, no Lightning.

    prompts ─> prefill: one pass over every prompt (right-padded) ─> logits of each last byte
        ┌────────────────────────────────────────────────────────────────┘
        └─> sample a byte per sequence ─> one pass over the new bytes ─> logits ─> sample ...

A pass runs the model's own sublayers (`Transformer.stream` with a `CachedPass`) on the new tokens
only; what a step needs of the earlier tokens is in the attention sublayers' KV caches, and each
token's residual state is its own. Each attention sublayer caches only the tokens that executed it,
as in training, so a routed model's cache is smaller (`nag_lightning.model.kv_cache`). Routers decide
for the new tokens alone, in eval mode, where every router must be causal (`Router.causal`): the
decisions are those a forward pass over the whole text would make.

Padding: prompts of different lengths are right-padded in the prefill; padding executes no
sublayer and writes no key or value, and every sequence continues from its own length at its own
positions, so a prompt's continuation does not depend on the other prompts of the batch.

Longer than `seq_len`: the rotary tables, and training, cover positions below `seq_len`. A prompt
longer than that is cut to its last `seq_len` bytes. When a sequence's context is full, its cache
is emptied and rebuilt from its last `seq_len // 2` bytes in one pass (at positions from 0), so
every byte is predicted from between `seq_len // 2` and `seq_len` bytes of context, exactly as a
forward pass over those bytes would predict it, and the cost stays linear in the bytes generated.
(The uncached reference of `nag-lightning generate --cache false` slides its window by one byte
per step instead; the two agree until a sequence first reaches `seq_len` bytes.)
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import torch
from torch import Tensor

from nag_lightning.model.kv_cache import CachedPass, KVCache
from nag_lightning.model.transformer import Transformer
from nag_lightning.registry import plugin_name


@dataclass
class Sampling:
    """How the next byte is chosen from the logits.

    Attributes:
        temperature: 0 for greedy decoding, else the softmax temperature.
        top_k: sample among the top_k most likely bytes only (0: all).
        top_p: sample from the smallest set of most likely bytes whose probability reaches top_p
            (nucleus sampling; 1: all).
        seed: sequence i of a batch samples with its own generator, seeded seed + i, so its
            continuation does not depend on the other sequences.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and self.top_k >= 0 and 0 < self.top_p <= 1):
            raise ValueError(
                f"Need temperature >= 0, top_k >= 0 and 0 < top_p <= 1; got {self.temperature}, "
                f"{self.top_k}, {self.top_p}."
            )

    def generators(self, n: int) -> list[torch.Generator]:
        return [torch.Generator().manual_seed(self.seed + i) for i in range(n)]


def sample(logits: Tensor, sampling: Sampling, generators: list[torch.Generator]) -> list[int]:
    """One byte per row of logits (R, vocab), row r drawing from generators[r]."""
    if sampling.temperature == 0:
        return logits.argmax(-1).tolist()
    logits = logits.detach().float().cpu() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        cutoff = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        # drop a byte when the more likely bytes already reach top_p (the most likely one stays)
        ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
    cdf = probs.cumsum(-1)
    draws = torch.stack([torch.rand((), generator=g) for g in generators]) * cdf[:, -1]
    # the first byte whose cumulative probability exceeds the draw: never one of probability 0
    picked = torch.searchsorted(cdf, draws.unsqueeze(-1), right=True).squeeze(-1)
    return picked.clamp_max(logits.shape[-1] - 1).tolist()


@dataclass
class Extension:
    """What one pass over new tokens gives.

    Attributes:
        logits: (B, vocab) fp32 at each sequence's last new token; zeros for sequences that got
            none.
        executed: (B, T) sublayers each new token ran (0 on padding).
        last: (B,) column of each sequence's last new token (-1: none).
    """

    logits: Tensor
    executed: Tensor
    last: Tensor


class CachedDecoder:
    """A batch of growing texts, each token computed once against per-sublayer KV caches.

    `extend` runs one pass over new tokens (a prompt, the next byte, or a window to rebuild) of
    any sequences, right-padded; `reset` empties sequences. The model must be in eval mode (its
    routers causal there) and stay unchanged while the decoder is used.

    Args:
        model: the Transformer.
        batch: number of sequences.
    """

    def __init__(self, model: Transformer, batch: int) -> None:
        if model.training:
            raise ValueError("Cached decoding routes as evaluation does; call model.eval() first.")
        for s in model.sublayers:
            if not s.router.causal:
                raise ValueError(
                    f"The {plugin_name(type(s.router))} router of sublayer {s.index} decides from the "
                    "whole sequence in eval mode, which generation cannot see; switch it to its "
                    "causal decision (top-k: eval_routing='predictor')."
                )
        cfg = model.cfg
        self.model = model
        self.batch = batch
        self.device = model.head.weight.device
        self.caches = {
            s.index: KVCache(batch, cfg.n_heads, cfg.d_model // cfg.n_heads,
                             s.compute.proj.weight.dtype, self.device, cfg.seq_len)
            for s in model.sublayers if s.kind == "attn"
        }
        self.length = [0] * batch  # tokens in each sequence's context: its next position

    def reset(self, rows: list[int]) -> None:
        """Empty the given sequences: their next token is at position 0."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        for cache in self.caches.values():
            cache.reset(index)
        for b in rows:
            self.length[b] = 0

    @torch.no_grad()
    def extend(self, chunks: list[list[int]]) -> Extension:
        """Run the new tokens chunks[b] of every sequence b (an empty list: none) through the
        model, append what they leave in the caches, and return the logits of each last one."""
        if len(chunks) != self.batch:
            raise ValueError(f"Expected new tokens for {self.batch} sequences; got {len(chunks)}.")
        seq_len = self.model.cfg.seq_len
        for b, chunk in enumerate(chunks):
            if self.length[b] + len(chunk) > seq_len:
                raise ValueError(
                    f"Sequence {b} would hold {self.length[b] + len(chunk)} tokens, more than "
                    f"model.arch.seq_len = {seq_len}; reset it and continue from its last bytes."
                )
        T = max(len(c) for c in chunks)
        if T == 0:
            raise ValueError("No new tokens to run; give at least one.")
        idx = torch.tensor([c + [0] * (T - len(c)) for c in chunks], device=self.device)  # (B, T)
        sizes = torch.tensor([len(c) for c in chunks], device=self.device)
        columns = torch.arange(T, device=self.device)
        valid = columns < sizes[:, None]
        starts = torch.tensor(self.length, device=self.device)
        positions = (starts[:, None] + columns).masked_fill(~valid, 0)  # padding: any position
        cached = CachedPass(self.caches, positions, None if bool(valid.all()) else valid)
        state = self.model.stream(idx, cached)
        last = sizes - 1
        rows = torch.arange(self.batch, device=self.device)
        logits = self.model.readout(tuple(lane[rows, last.clamp_min(0)] for lane in state)).float()
        for b, chunk in enumerate(chunks):
            self.length[b] += len(chunk)
        return Extension(
            logits=logits.masked_fill((last < 0)[:, None], 0.0),
            executed=cached.executed_counts(),
            last=last,
        )

    def cache_bytes(self) -> dict[str, int]:
        """Bytes of the live cache entries (`live`), of the storage held (`allocated`), and of the
        entries a cache without routing would hold for the same contexts (`unrouted`)."""
        entry = next(iter(self.caches.values())).entry_bytes
        return {
            "live": sum(c.nbytes() for c in self.caches.values()),
            "allocated": sum(c.allocated_bytes() for c in self.caches.values()),
            "unrouted": sum(self.length) * len(self.caches) * entry,
        }

    def row_bytes(self, b: int) -> tuple[int, int]:
        """Bytes of sequence b's live cache entries, and of those a cache without routing would
        hold for its context."""
        entry = next(iter(self.caches.values())).entry_bytes
        live = sum(int(c.length[b]) * c.entry_bytes for c in self.caches.values())
        return live, self.length[b] * len(self.caches) * entry


@dataclass
class Continuation:
    """The bytes generated after one prompt.

    Attributes:
        tokens: the continuation's byte values.
        executed: for each of them, the sublayers that ran at the position it was predicted from.
        stopped: whether it ended with the stop string (which it keeps).
        cache_bytes: bytes of its KV cache entries at the end (its last window's).
        unrouted_cache_bytes: bytes a cache without routing would hold for the same context.
    """

    tokens: list[int] = field(default_factory=list)
    executed: list[int] = field(default_factory=list)
    stopped: bool = False
    cache_bytes: int = 0
    unrouted_cache_bytes: int = 0


def generate_cached(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop: bytes | list[bytes] | None = None,
    on_token: Callable[[int, int], None] | None = None,
    decode: Callable[[list[int]], bytes] = bytes,
) -> tuple[list[Continuation], dict[str, int]]:
    """Continue each prompt (token ids: byte values for a byte-level model) by up to
    `max_new_tokens` tokens, or until its continuation, turned into bytes by `decode`, ends with
    `stop` (or any of a list of stops); `on_token(i, token)` is called as each token of prompt i arrives.
    The model is switched to eval mode and back. Returns the continuations and the KV cache's
    bytes at the end (see `CachedDecoder.cache_bytes`)."""
    tokens = stream_cached(model, prompts, max_new_tokens, sampling, stop, decode)
    while True:
        try:
            i, token = next(tokens)
        except StopIteration as end:
            return end.value
        if on_token is not None:
            on_token(i, token)


def stream_cached(
    model: Transformer,
    prompts: list[list[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop: bytes | list[bytes] | None = None,
    decode: Callable[[list[int]], bytes] = bytes,
) -> Generator[tuple[int, int], None, tuple[list[Continuation], dict[str, int]]]:
    """`generate_cached` as an iterator: yields (i, token) as each token of prompt i arrives, and
    returns (as `StopIteration.value`) the continuations and the KV cache's bytes. The model is in
    eval mode while the iterator runs, and back in its own mode once it ends or is closed."""
    sampling = sampling or Sampling()
    if not prompts or any(not p for p in prompts):
        raise ValueError("A prompt is empty; give at least one character to continue.")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be 0 or more; got {max_new_tokens}.")
    stops = [stop] if isinstance(stop, bytes) else list(stop or [])
    if not all(stops):
        raise ValueError("The stop string is empty; give at least one character, or none.")
    seq_len = model.cfg.seq_len
    keep = max(1, seq_len // 2)  # context kept when a window is rebuilt
    results = [Continuation() for _ in prompts]
    generators = sampling.generators(len(prompts))
    was_training = model.training
    model.eval()
    try:
        decoder = CachedDecoder(model, len(prompts))
        if max_new_tokens == 0:
            return results, decoder.cache_bytes()
        texts = [list(p) for p in prompts]
        active = list(range(len(prompts)))
        step = decoder.extend([t[-seq_len:] for t in texts])
        while active:
            executed = step.executed[torch.arange(len(prompts)), step.last.clamp_min(0)].tolist()
            picked = sample(step.logits[active], sampling, [generators[b] for b in active])
            chunks: list[list[int]] = [[] for _ in prompts]
            rebuild = []
            for b, token in zip(list(active), picked):
                out = results[b]
                out.tokens.append(token)
                out.executed.append(executed[b])
                texts[b].append(token)
                yield b, token
                # every token stands for at least one byte, so the last len(stop) tokens hold it
                out.stopped = any(decode(out.tokens[-len(s):]).endswith(s) for s in stops)
                if out.stopped or len(out.tokens) == max_new_tokens:
                    active.remove(b)
                elif decoder.length[b] < seq_len:
                    chunks[b] = [token]
                else:  # context full: start a new window from the last `keep` bytes
                    rebuild.append(b)
                    chunks[b] = texts[b][-keep:]
            if rebuild:
                decoder.reset(rebuild)
            if active:
                step = decoder.extend(chunks)
        for b, out in enumerate(results):
            out.cache_bytes, out.unrouted_cache_bytes = decoder.row_bytes(b)
        return results, decoder.cache_bytes()
    finally:
        model.train(was_training)
