"""This package's models in lm-evaluation-harness (`lm-eval`): the model `nag-lightning` of its
registry. Needs the optional extra: `pip install 'nag-lightning[eval]'`.

    nag-lightning eval --ckpt_path CKPT_OR_DIR --tasks hellaswag            (the package's command)
    python -m nag_lightning.analysis.evaluation.lm_eval_model --model nag-lightning --model_args ckpt=CKPT \
        --tasks hellaswag                                                   (lm-eval's own command)

lm-eval finds a model by name only in its registry, which it fills from its own modules; it has
no plugin discovery (no entry points), so the registration below runs when this module is
imported: by the two commands above, or by `import nag_lightning.analysis.evaluation.lm_eval_model` before
`lm_eval.simple_evaluate(model="nag-lightning", ...)`.

How the model answers, in batches of `batch_size` sequences:
- `loglikelihood`: each (context, continuation) as the model's input, cut to its last `seq_len`
  tokens; the continuation's log-probability and whether greedy decoding gives it.
- `loglikelihood_rolling`: a text cut into lm-eval's disjoint windows of `seq_len` predictions
  (`get_rolling_token_windows`, context 1), the first conditioned on `prefix_token`, summed. The
  package's own evaluation of the same windows (rows of `seq_len + 1` tokens that overlap by one,
  the first starting with `prefix_token`) gives the same bits per byte (tests/test_lm_eval.py).
- `generate_until`: the package's KV-cache generation (`nag_lightning.model.inference`), so a token that
  skips a sublayer costs it nothing, stopped at any of the `until` strings, which are cut off.

Rows of a batch are right-padded; padding cannot change a real token's result when every router
decides causally in eval mode (`Router.causal`), and otherwise only rows of equal length share a
batch. Any of the package's tokenizers works: text is encoded as UTF-8 bytes by the checkpoint's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nag_lightning.analysis.checks import check_device
from nag_lightning.checkpoints.loading import load_model
from nag_lightning.model.inference import Sampling, generate_cached

MAX_GEN_TOKS = 256  # lm-eval's usual default for `generate_until`
GENERATION_OPTIONS = ("until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p", "seed")


@register_model("nag-lightning")
class NagLM(TemplateLM):
    """A checkpoint (or a folder of `nag-lightning export`) as an lm-eval model.

    Args:
        ckpt: the checkpoint's path (`--model_args ckpt=...`).
        batch_size: sequences per forward pass.
        max_batch_size: ignored (lm-eval passes it; batches here have a fixed size).
        device: where the model runs (cpu, cuda, cuda:N, mps); None: cuda if there is one.
        trust_checkpoint: let a plugin named by a class path outside the registries be built.
        prefix_token: the token id the first token of a text is predicted from (lm-eval's end of
            text); None: the id of a newline.
    """

    def __init__(self, ckpt: str, batch_size: int | str = 1, max_batch_size: int | None = None,
                 device: str | None = None, trust_checkpoint: bool = False,
                 prefix_token: int | None = None) -> None:
        super().__init__()
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        check_device(device)
        self.batch_size = _batch_size(batch_size)
        loaded = load_model(str(ckpt), device, trust_checkpoint)
        self.model, self.tok = loaded.model, loaded.tokenizer
        self.seq_len = self.model.cfg.seq_len
        self._device = torch.device(device)
        if prefix_token is None:
            prefix_token = int(self.tok.encode(b"\n")[0])
        if not 0 <= int(prefix_token) < self.model.cfg.vocab_size:
            raise ValueError(f"prefix_token={prefix_token} is not a token id of the model (0 to "
                             f"{self.model.cfg.vocab_size - 1}); give one, or leave it out for a newline.")
        self._prefix = int(prefix_token)
        # padding a row can change another token's routing only under a router that is not causal
        self.pads = all(s.router.causal for s in self.model.sublayers)

    @property
    def eot_token_id(self) -> int:
        return self._prefix

    @property
    def max_length(self) -> int:
        return self.seq_len

    @property
    def device(self) -> torch.device:
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string.encode("utf-8")).tolist()

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        return self.tok.decode(tokens).decode("utf-8", errors="replace")

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs
                              ) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation after its context, cut to the window."""
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.seq_len + 1):]
            rows.append((whole[:-1], whole[1:], min(len(continuation), len(whole) - 1)))
        answers: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        for batch in self._batches(rows):
            width = max(len(rows[i][0]) for i in batch)
            idx = torch.tensor([rows[i][0] + [0] * (width - len(rows[i][0])) for i in batch],
                               device=self.device)  # (B, T), right-padded
            logprobs = F.log_softmax(self.model(idx).logits.float(), dim=-1)  # (B, T, vocab)
            for b, i in enumerate(batch):
                inputs, targets, n = rows[i]
                span = logprobs[b, len(inputs) - n: len(inputs)]  # (n, vocab)
                wanted = torch.tensor(targets[len(targets) - n:], device=self.device)
                score = span.gather(-1, wanted[:, None]).sum().item()
                answers[i] = (score, bool((span.argmax(-1) == wanted).all()))
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def _batches(self, rows: list[tuple[list[int], list[int], int]]) -> list[list[int]]:
        """Indices of `rows`, longest first, in batches of at most `batch_size` (of equal length
        only, unless padding is safe)."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        batches: list[list[int]] = []
        for i in order:
            last = batches[-1] if batches else None
            if (last is not None and len(last) < self.batch_size
                    and (self.pads or len(rows[last[0]][0]) == len(rows[i][0]))):
                last.append(i)
            else:
                batches.append([i])
        return batches

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-probability of each whole text, over lm-eval's disjoint windows of `seq_len`."""
        windows, owners = [], []
        for n, (text, *_) in enumerate(req.args for req in requests):
            pairs = get_rolling_token_windows(token_list=self.tok_encode(text), prefix_token=self._prefix,
                                              max_seq_len=self.seq_len, context_len=1)
            for context, continuation in map(make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (score, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[n] += score
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context continued with the KV cache until an `until` string (cut off) or
        `max_gen_toks` tokens; requests with the same options run as one batch."""
        answers: list[str] = [""] * len(requests)
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        for members in groups.values():
            until, max_new, sampling = _generation_options(requests[members[0]].args[1])
            for start in range(0, len(members), self.batch_size):
                batch = members[start: start + self.batch_size]
                prompts = [self.tok_encode(requests[i].args[0]) or [self._prefix] for i in batch]
                results, _ = generate_cached(self.model, prompts, max_new, sampling,
                                             stop=[u.encode("utf-8") for u in until], decode=self.tok.decode)
                for i, result in zip(batch, results):
                    text = self.tok_decode(result.tokens)
                    for stop in until:
                        text = text.split(stop)[0]
                    answers[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return answers


def _batch_size(value: int | str) -> int:
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1:
        raise ValueError(f"batch_size={value!r} is not a number of sequences; give one of at least 1 "
                         "(lm-eval's 'auto' is not supported).")
    return size


def _generation_options(options: dict) -> tuple[list[str], int, Sampling]:
    """lm-eval's generation options as (until strings, most new tokens, sampling)."""
    unknown = sorted(set(options) - set(GENERATION_OPTIONS))
    if unknown:
        raise ValueError(f"The task asks for generation options {', '.join(unknown)}, which the "
                         f"nag-lightning model does not take; it takes {', '.join(GENERATION_OPTIONS)}.")
    until = options.get("until") or []
    until = [until] if isinstance(until, str) else [u for u in until if u]
    sample = bool(options.get("do_sample")) or (options.get("temperature") or 0) > 0
    sampling = Sampling(temperature=float(options.get("temperature", 1.0) or 1.0) if sample else 0.0,
                        top_k=int(options.get("top_k") or 0), top_p=float(options.get("top_p") or 1.0),
                        seed=int(options.get("seed") or 0))
    return until, int(options.get("max_gen_toks", MAX_GEN_TOKS)), sampling


if __name__ == "__main__":  # lm-eval's own command, with the model registered
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
