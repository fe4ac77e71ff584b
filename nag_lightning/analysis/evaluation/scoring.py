"""How well a model predicts a text: the loss of every token given the ones before it, in nats and
in bits per byte, and the text's totals.

Token t is predicted from tokens 0 to t-1; the first token has nothing before it and is not
scored (NaN). A text longer than the model's context is scored in windows: the first covers the
context, each later one scores the next seq_len // 2 tokens from the seq_len tokens before them,
so every token is predicted from at least half a context, and each is scored once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from nag_lightning.analysis.evaluation.token_depth import token_texts
from nag_lightning.data.tokenizer import Tokenizer
from nag_lightning.model import Transformer


@dataclass(frozen=True)
class TextScore:
    """A text's loss under a model.

    Attributes:
        text: the text scored.
        tokens: its T tokens, each as its text (`token_depth.token_texts`).
        loss: (T,) nats of each token given the ones before it; NaN for the first token.
        token_bytes: (T,) the bytes each token stands for.
    """

    text: str
    tokens: list[str]
    loss: Tensor
    token_bytes: Tensor

    @property
    def bits_per_byte_per_token(self) -> Tensor:
        """(T,) each token's loss in bits over the bytes it stands for; NaN for the first token."""
        return self.loss / math.log(2) / self.token_bytes.clamp_min(1)

    @property
    def mean_loss(self) -> float:
        """Nats per scored token (NaN for a text of one token)."""
        return self.loss[1:].mean().item() if len(self.tokens) > 1 else math.nan

    @property
    def bits_per_byte(self) -> float:
        """The text's loss in bits over the bytes of its scored tokens (NaN for a text of one token)."""
        if len(self.tokens) < 2:
            return math.nan
        return self.loss[1:].sum().item() / math.log(2) / max(int(self.token_bytes[1:].sum()), 1)


@torch.no_grad()
def score_text(model: Transformer, tokenizer: Tokenizer, text: str) -> TextScore:
    """The `TextScore` of `text` (its UTF-8 bytes encoded with `tokenizer`) under `model`, which
    routes as it is set up; one sentence for an empty text."""
    ids = tokenizer.encode(text.encode("utf-8")).tolist()
    if not ids:
        raise ValueError("A text to score is empty; give at least one character.")
    device = model.head.weight.device
    tokens = torch.tensor(ids, device=device)
    loss = torch.full((len(ids),), math.nan)
    seq_len, stride = model.cfg.seq_len, max(1, model.cfg.seq_len // 2)
    first = 1  # the next token to score
    while first < len(ids):
        end = min(len(ids), seq_len + 1) if first == 1 else min(len(ids), first + stride)
        start = max(0, end - 1 - seq_len)
        logits = model(tokens[start:end - 1][None]).logits[0].float()  # (end - 1 - start, vocab)
        nll = F.cross_entropy(logits, tokens[start + 1:end], reduction="none")  # of tokens start+1..end-1
        loss[first:end] = nll[first - start - 1:].cpu()
        first = end
    lengths = torch.tensor([len(tokenizer.token_bytes[i]) for i in ids])
    return TextScore(text, token_texts(tokenizer, ids), loss, lengths)
