"""`nag-lightning generate`: continue a prompt from a checkpoint, token by token, with causal routing.

The prompt is encoded, and the output decoded, with the checkpoint's own tokenizer (bytes, or the
tokenizer.json the checkpoint holds). The continuation is printed as it is generated; a token that
ends inside a UTF-8 character is held back until the tokens that complete it arrive.

The model runs in eval mode, where every router decides from the token's own state alone:
threshold compares its predicted angle with tau, top-k asks its causal predictor (the exact top-k
of a sequence would look at tokens not generated yet). Each step recomputes the whole prefix (at
most `seq_len` tokens), which is correct by construction: a causal model gives the prefix the same
logits and routes every time. For each generated token it reports how many sublayers ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from nag_lightning.model import Transformer
from nag_lightning.routers import Route
from nag_lightning.tokenizer import BYTES, StreamDecoder, Tokenizer


@dataclass
class Generation:
    """A generated continuation.

    Attributes:
        prompt: the prompt text.
        text: the continuation, decoded as UTF-8 (invalid bytes replaced).
        tokens: the continuation's token ids (byte values, for bytes).
        executed: for each generated token, the sublayers that ran at the position it was
            predicted from (the compute that produced it).
        n_sublayers: sublayers in the model.
        tokenizer: the checkpoint's tokenizer.
    """

    prompt: str
    text: str
    tokens: list[int]
    executed: list[int]
    n_sublayers: int
    tokenizer: Tokenizer

    @property
    def mod_rate(self) -> float:
        """Skipped (token, sublayer) executions over all of them, for the generated tokens."""
        return 1 - sum(self.executed) / max(len(self.executed) * self.n_sublayers, 1)


def sample_next(logits: Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    """Greedy when temperature is 0, else sample from softmax(logits / temperature) restricted
    to the top_k most likely tokens (0: all)."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        cutoff = logits.topk(top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def use_causal_routing(model: Transformer) -> None:
    """Eval mode, and top-k routers on their causal predictor whatever they were set to."""
    model.eval()
    for s in model.sublayers:
        if getattr(s.router, "eval_routing", None) == "topk":
            s.router.eval_routing = "predictor"


@torch.no_grad()
def generate_tokens(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    on_token: Callable[[int], None] | None = None,
) -> tuple[list[int], list[int]]:
    """The continuation of `prompt` (token ids) and the sublayers executed per generated token;
    `on_token` is called with each token as soon as it is chosen."""
    if not prompt:
        raise ValueError("The prompt is empty; give at least one character to continue.")
    if temperature < 0 or top_k < 0 or max_new_tokens < 0:
        raise ValueError(
            f"Need temperature >= 0, top_k >= 0 and max_new_tokens >= 0; got {temperature}, "
            f"{top_k}, {max_new_tokens}."
        )
    use_causal_routing(model)
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    last_executed: list[Tensor] = []

    def record(router, args, route: Route) -> None:
        # whether the newest token (last position) runs this sublayer
        last_executed.append(torch.ones(()) if route.executed is None else route.executed[0, -1].cpu())

    hooks = [s.router.register_forward_hook(record) for s in model.sublayers]
    tokens, executed = list(prompt), []
    try:
        for _ in range(max_new_tokens):
            window = torch.tensor(tokens[-model.cfg.seq_len:], device=device).unsqueeze(0)  # (1, T)
            last_executed.clear()
            logits = model(window).logits[0, -1]  # (vocab,)
            tokens.append(sample_next(logits, temperature, top_k, generator))
            if on_token is not None:
                on_token(tokens[-1])
            # The routes of the last input position: the token the new byte was predicted from
            executed.append(int(sum(e.item() for e in last_executed)))
    finally:
        for hook in hooks:
            hook.remove()
    return tokens[len(prompt):], executed


def generate(
    ckpt_path: str,
    prompt: str = "def ",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    device: str = "cpu",
    show_routing: bool = False,
    trust_checkpoint: bool = False,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Continue `prompt` with a trained model and report the sublayers executed per token.

    Args:
        ckpt_path: a .ckpt file written by `nag-lightning fit`.
        prompt: text to continue (encoded with the checkpoint's tokenizer).
        max_new_tokens: tokens to generate (bytes, for a byte-level model).
        temperature: 0 for greedy decoding, else the softmax temperature of sampling.
        top_k: sample among the top_k most likely tokens only (0: all); ignored when greedy.
        seed: seed of the sampler.
        device: where to run ("cpu", "cuda").
        show_routing: print, for each generated token, how many sublayers ran.
        trust_checkpoint: let the checkpoint's residual or router import and call a class path
            outside the registered plugins; only for checkpoints whose origin you trust.
        on_text: called with the text of each generated token as soon as it is chosen (empty
            while a UTF-8 character is incomplete), and once at the end with what is left.
    """
    from nag_lightning.analysis.sweep import load_checkpoint
    from nag_lightning.module import NAGLanguageModel

    module = load_checkpoint(NAGLanguageModel, ckpt_path, device, trust_checkpoint)
    tokenizer = module.tokenizer
    decoder = StreamDecoder(tokenizer)
    on_token = None if on_text is None else lambda token: on_text(decoder.push(token))
    tokens, executed = generate_tokens(
        module.model, tokenizer.encode(prompt.encode("utf-8")).tolist(), max_new_tokens,
        temperature, top_k, seed, on_token,
    )
    if on_text is not None:
        on_text(decoder.flush())
    return Generation(
        prompt=prompt,
        text=tokenizer.decode(tokens).decode("utf-8", errors="replace"),
        tokens=tokens,
        executed=executed,
        n_sublayers=len(module.model.sublayers),
        tokenizer=tokenizer,
    )


def generate_command(args: list[str]) -> None:
    """`nag-lightning generate`: continue a prompt from a checkpoint with causal routing."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(prog="nag-lightning generate", description=generate.__doc__.split("\n")[0])
    parser.add_function_arguments(generate, skip={"on_text"})
    options = parser.parse_args(args).as_dict()
    started = []

    def show(text: str) -> None:  # the prompt once the checkpoint loaded, then the text as it comes
        if not started:
            print(options["prompt"], end="", flush=True)
            started.append(True)
        print(text, end="", flush=True)

    result = generate(**options, on_text=show)
    print()
    if options["show_routing"]:
        for token, n in zip(result.tokens, result.executed):
            print(f"{result.tokenizer.token_bytes[token]!r:>12}  {n}/{result.n_sublayers} sublayers")
    mean = sum(result.executed) / max(len(result.executed), 1)
    unit = "byte" if result.tokenizer.key == BYTES else "token"
    print(f"sublayers executed per generated {unit}: {mean:.2f} of {result.n_sublayers} "
          f"(MoD rate {100 * result.mod_rate:.1f}%)")
