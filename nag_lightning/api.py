"""A trained model from Python: `nag_lightning.load(path)`, then `generate`, `score` and `depth`.

    import nag_lightning
    llm = nag_lightning.load("runs/quickstart/version_0/checkpoints/last.ckpt")  # or an export
    print(llm.generate("def main(", max_new_tokens=40))
    print(llm.score("import os\\n")[0].bits_per_byte)
    print(llm.depth("for x in y:").table())  # angle per token and sublayer, '-' where skipped

The path goes through the one loader (`nag_lightning.checkpoints.loading.load_model`, every check
of a checkpoint or an export). The model then stays in eval mode with every router on its causal
decision, as `nag-lightning generate` runs it, so generation, scores and depth maps route alike.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Literal, overload

from nag_lightning.analysis.checks import check_device
from nag_lightning.analysis.evaluation.generate import check_generate_options, use_causal_routing
from nag_lightning.analysis.evaluation.scoring import TextScore, score_text
from nag_lightning.analysis.evaluation.token_depth import DepthMap, depth_map
from nag_lightning.checkpoints.formats import SavedFormat, saved_format
from nag_lightning.checkpoints.loading import LoadedModel, SavedTask, load_model
from nag_lightning.data.tokenizer import StreamDecoder, Tokenizer
from nag_lightning.model import Transformer
from nag_lightning.model.inference import Sampling, stream_cached

__all__ = ["DepthMap", "TextScore", "TrainedModel", "load"]


class TrainedModel:
    """A trained model with its tokenizer, ready to generate, score and map depth.

    Args:
        loaded: the model as `load_model` returns it.
    """

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        use_causal_routing(loaded.model)  # eval mode, top-k on its causal predictor

    @property
    def model(self) -> Transformer:
        """The `Transformer`, in eval mode."""
        return self.loaded.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def task(self) -> SavedTask | None:
        """The synthetic task the run trained on, or None for text."""
        return self.loaded.task

    def __repr__(self) -> str:
        cfg = self.model.cfg
        return (f"TrainedModel({self.loaded.source!r}: residual {cfg.residual}, router {cfg.router}, "
                f"{cfg.n_layers} blocks of width {cfg.d_model}, {self.tokenizer.describe()})")

    @overload
    def generate(self, prompt: str, max_new_tokens: int = ..., temperature: float = ..., top_k: int = ...,
                 top_p: float = ..., seed: int = ..., stop: str | None = ...,
                 stream: Literal[False] = ...) -> str: ...

    @overload
    def generate(self, prompt: str, max_new_tokens: int = ..., temperature: float = ..., top_k: int = ...,
                 top_p: float = ..., seed: int = ..., stop: str | None = ...,
                 *, stream: Literal[True]) -> Iterator[str]: ...

    def generate(self, prompt: str, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, stop: str | None = None,
                 stream: bool = False) -> str | Iterator[str]:
        """The continuation of `prompt`, generated with the KV cache (each token computed once).

        Args:
            prompt: the text to continue (its UTF-8 bytes, encoded with the model's tokenizer).
            max_new_tokens: most tokens to generate.
            temperature: 0 for greedy decoding, else the softmax temperature of sampling.
            top_k: sample among the top_k most likely tokens only (0: all).
            top_p: sample from the smallest set of most likely tokens reaching top_p (1: all).
            seed: seed of the sampler.
            stop: end once the continuation ends with this text (which it keeps).
            stream: return an iterator of text pieces as the tokens arrive (a character split
                over several tokens arrives whole) instead of the whole continuation.
        """
        check_generate_options([prompt], max_new_tokens, str(self.model.head.weight.device), seed)
        sampling = Sampling(temperature, top_k, top_p, seed)  # one sentence for a bad setting, now
        stop_bytes = None if stop is None else os.fsencode(stop)
        if stop_bytes == b"":
            raise ValueError("The stop string is empty; give at least one character, or none.")
        pieces = self._pieces(prompt, max_new_tokens, sampling, stop_bytes)
        return pieces if stream else "".join(pieces)

    def _pieces(self, prompt: str, max_new_tokens: int, sampling: Sampling,
                stop: bytes | None) -> Iterator[str]:
        ids = self.tokenizer.encode(os.fsencode(prompt)).tolist()
        decoder = StreamDecoder(self.tokenizer)
        tokens = stream_cached(self.model, [ids], max_new_tokens, sampling, stop, self.tokenizer.decode)
        for _, token in tokens:
            if piece := decoder.push(token):
                yield piece
        if rest := decoder.flush():
            yield rest

    def score(self, texts: str | list[str]) -> list[TextScore]:
        """Each text's loss and bits per byte, in total and per token (`TextScore`); a text longer
        than the model's context is scored in windows (`scoring`)."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        if not texts:
            raise ValueError("No text to score; give a text or a list of texts.")
        return [score_text(self.model, self.tokenizer, text) for text in texts]

    def depth(self, text: str) -> DepthMap:
        """Per token and sublayer: the angle it turned by, the sublayer's bound, and whether it ran
        under the model's router (`DepthMap`); the text must fit the model's context."""
        return depth_map(self.model, self.tokenizer, text)


def load(path: str | Path, device: str = "cpu", trust_checkpoint: bool = False) -> TrainedModel:
    """The trained model at `path`, ready to use from Python.

    Args:
        path: a .ckpt file written by `nag-lightning fit` (or its URL), or a folder written by
            `nag-lightning export`, in its own format or as a transformers folder (`--format hf`,
            read with the extra `hf`).
        device: where the model runs ("cpu", "cuda").
        trust_checkpoint: let a residual or router named by a class path outside the registered
            plugins be imported and built; only for checkpoints whose origin you trust.
    """
    check_device(device)
    if saved_format(path) is SavedFormat.HF:
        try:
            from nag_lightning.hf.reading import read_hf_saved
        except ImportError as error:
            raise ImportError(
                f"{path} is a transformers folder, which needs the extra hf: pip install "
                f"'nag-lightning[hf]' ({error})."
            ) from None
        path = read_hf_saved(path)
    return TrainedModel(load_model(path, device, trust_checkpoint))
