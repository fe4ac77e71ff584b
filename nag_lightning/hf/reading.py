"""A Hugging Face folder read back into the package's `Transformer` and `Tokenizer` (`read_hf`):
one `nag-lightning export --format hf` wrote, or any Llama folder whose settings the package's
pre-norm model can express. JSON and safetensors only, never a pickle, never code from the folder;
what is missing, damaged or does not match is said in one sentence.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path

import torch

from nag_lightning.checkpoints.exported import CONFIG, MODEL_PREFIX, WEIGHTS
from nag_lightning.checkpoints.reader import SavedCheckpoint, fitting_weights
from nag_lightning.checkpoints.values import check_finite
from nag_lightning.data.tokenizer import Tokenizer
from nag_lightning.hf.configuration import MODEL_TYPE, NagLightningConfig
from nag_lightning.hf.llama import LLAMA, arch_from_llama, from_llama
from nag_lightning.hf.modeling import NagLightningForCausalLM
from nag_lightning.hf.tokenizer_files import read_tokenizer
from nag_lightning.model import Transformer, TransformerConfig

SHARDS = "model.safetensors.index.json"  # the weights of a large folder, in several files


def read_hf(path: str | Path, device: str = "cpu") -> tuple[Transformer, Tokenizer]:
    """The model of the transformers folder `path`, in eval mode on `device`, and its tokenizer.

    A folder of model type nag_lightning is rebuilt from its settings through the package's
    registries; a Llama folder as the pre-norm model it is (`nag_lightning.hf.llama`)."""
    folder, source = Path(path), str(path)
    config = _read_json(folder / CONFIG, source)
    weights = _read_weights(folder, source)
    if config.get("model_type") == MODEL_TYPE:
        settings = NagLightningConfig.from_dict(config)
        cfg = settings.transformer_config()
        prefix = NagLightningForCausalLM.base_model_prefix + "."
        weights = {k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}
        weights |= settings.extra_state
        tokenizer = read_tokenizer(folder, cfg.vocab_size, source, settings.tokenizer_spec,
                                   settings.tokenizer_key)
    elif config.get("model_type") == LLAMA:
        cfg = TransformerConfig(**arch_from_llama(config, source))
        tied = bool(config.get("tie_word_embeddings")) and "lm_head.weight" not in weights
        try:
            weights = from_llama(weights, cfg, tied)
        except KeyError as missing:
            raise ValueError(
                f"The Llama folder {source} holds no weight {missing}; give a complete folder."
            ) from None
        tokenizer = read_tokenizer(folder, cfg.vocab_size, source)
    else:
        raise ValueError(
            f"The folder {source} holds a model of type {config.get('model_type')!r}; the package "
            f"reads {MODEL_TYPE!r} and {LLAMA!r} folders (those `nag-lightning export --format hf` writes)."
        )
    model = Transformer(cfg)
    with fitting_weights(model.state_dict(), weights, source):
        model.load_state_dict(weights)
    return model.to(device).eval(), tokenizer


def read_hf_saved(path: str | Path) -> SavedCheckpoint:
    """The transformers folder `path` as the checkpoint an export of the same model reads as
    (settings, weights, tokenizer; no training state), so that the one loader
    (`nag_lightning.checkpoints.loading.load_model`) builds and checks it as it does any other."""
    model, tokenizer = read_hf(path)
    state_dict = {MODEL_PREFIX + name: value for name, value in model.state_dict().items()}
    raw = {
        "hyper_parameters": {"arch": asdict(model.cfg)},
        "state_dict": state_dict,
        "tokenizer": tokenizer.saved(),
        "global_step": 0,
        "epoch": 0,
        "pytorch-lightning_version": version("lightning"),
    }
    return SavedCheckpoint(str(path), raw, exported=True)


def _read_json(file: Path, source: str) -> dict:
    if not file.is_file():
        raise FileNotFoundError(
            f"The folder {source} holds no {file.name}, so it is not a transformers model folder; give "
            "one written by `nag-lightning export --format hf`."
        )
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as error:
        raise ValueError(f"The {file.name} of {source} is not valid JSON ({str(error)[:120]}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"The {file.name} of {source} is not a JSON object of settings.")
    return config


def _read_weights(folder: Path, source: str) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the files a sharded folder's index names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if (folder / WEIGHTS).is_file():
        files = [folder / WEIGHTS]
    elif (folder / SHARDS).is_file():
        index = _read_json(folder / SHARDS, source).get("weight_map")
        names = index.values() if isinstance(index, dict) else [None]
        if not all(isinstance(name, str) and "/" not in name for name in names):
            raise ValueError(f"The {SHARDS} of {source} has no weight_map of file names in its folder.")
        files = [folder / name for name in sorted(set(index.values()))]
    else:
        raise FileNotFoundError(
            f"The folder {source} holds no {WEIGHTS} (nor {SHARDS}); the package reads weights from "
            "safetensors only, never from a pickle such as pytorch_model.bin."
        )
    weights = {}
    for file in files:
        try:
            weights |= load_file(str(file))
        except (SafetensorError, OSError, ValueError, RuntimeError) as error:
            raise ValueError(
                f"The {file.name} of {source} is not a readable safetensors file ({str(error)[:120]})."
            ) from None
    check_finite(weights, source)
    return weights
