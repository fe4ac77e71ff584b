"""The folder format of `nag-lightning export` read back: whether a path is such a folder
(`is_exported`) and its contents as the dict a checkpoint holds (`read_exported`), from JSON and
safetensors only, never a pickle. The one checkpoint reader (`nag_lightning.checkpoints.reader`)
reads a folder through it; `nag_lightning.checkpoints.export` writes one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path

import torch

from nag_lightning.data.tokenizer import BYTES, HFTokenizer, Tokenizer
from nag_lightning.inputs import shorten

WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.json"
FORMAT = "nag-lightning"
FORMAT_VERSION = 1
EXTRA_STATE = "_extra_state"
MODEL_PREFIX = "model."  # as in `nag_lightning.checkpoints.reader`: the Transformer inside the module


def is_exported(path: str | Path) -> bool:
    """Whether `path` is a local folder to read as an export: any folder but a sharded
    checkpoint (torch.distributed.checkpoint writes a `.metadata` file into its folder)."""
    path = Path(path)
    return "://" not in str(path) and path.is_dir() and not (path / ".metadata").exists()


def read_exported(path: str | Path) -> dict:
    """The folder `path` as the dict a checkpoint of `nag-lightning fit` holds (settings, weights
    under the module's prefix, tokenizer, step), read from JSON and safetensors only; one sentence
    (FileNotFoundError, ValueError) for a file that is missing, damaged or not what `export`
    writes."""
    folder = Path(path)
    for name in (CONFIG, WEIGHTS, TOKENIZER):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"The folder {path} holds no {name}, so it is not a model written by `nag-lightning "
                "export`; give such a folder (with config.json, model.safetensors and "
                "tokenizer.json), or a .ckpt file."
            )
    config = _read_config(folder / CONFIG, path)
    weights = _read_weights(folder / WEIGHTS, path)
    state_dict = {MODEL_PREFIX + k: v for k, v in weights.items()}
    state_dict.update({MODEL_PREFIX + k: dict(v) for k, v in config["extra_state"].items()})
    return {
        "hyper_parameters": {**config["module"], "arch": config["arch"]},
        "state_dict": state_dict,
        "tokenizer": _read_tokenizer(folder / TOKENIZER, config["tokenizer"]["spec"], path),
        "datamodule_hyper_parameters": config["data"],
        "global_step": config["global_step"],
        "epoch": 0,
        # Lightning's restore (`validate --ckpt_path DIR`) reads the version it was written with
        "pytorch-lightning_version": version("lightning"),
    }


def _read_config(file: Path, source: str | Path) -> dict:
    try:
        config = json.loads(file.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as error:  # Recursion: nested too deep
        raise ValueError(
            f"The {CONFIG} of {source} is not valid JSON ({str(error)[:120]}); export the "
            "checkpoint again with `nag-lightning export`."
        ) from None
    expected = {"arch": Mapping, "module": Mapping, "extra_state": Mapping, "tokenizer": Mapping,
                "data": Mapping, "global_step": int}
    problem = None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        problem = f"it does not say format: {FORMAT!r}"
    elif config.get("format_version") != FORMAT_VERSION:
        problem = f"format_version {shorten(repr(config.get('format_version')))} is not {FORMAT_VERSION}"
    else:
        wrong = [k for k, kind in expected.items() if not isinstance(config.get(k), kind)
                 or isinstance(config.get(k), bool)]
        if wrong:
            problem = f"{wrong[0]} is missing or not a {expected[wrong[0]].__name__.lower()}"
        elif not all(isinstance(v, Mapping) for v in config["extra_state"].values()):
            problem = "an entry of extra_state is not a mapping"
        elif not all(k.endswith(EXTRA_STATE) for k in config["extra_state"]):
            problem = f"an entry of extra_state is not named *.{EXTRA_STATE}"
        elif not isinstance(config["tokenizer"].get("spec"), str):
            problem = "tokenizer.spec is not a string"
    if problem:
        raise ValueError(
            f"The {CONFIG} of {source} is not one `nag-lightning export` writes ({problem}); "
            "export the checkpoint again."
        )
    return config


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _read_weights(file: Path, source: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise ValueError(
            f"The {WEIGHTS} of {source} is not a readable safetensors file ({str(error)[:120]}); "
            "export the checkpoint again with `nag-lightning export`."
        ) from None
    bad = next((k for k, v in weights.items() if not (v.is_floating_point() or v.dtype == torch.int64)
                or (v.is_floating_point() and not bool(torch.isfinite(v).all()))), None)
    if bad is not None:
        value = weights[bad]
        what = "not finite" if value.is_floating_point() else f"of dtype {value.dtype}"
        raise ValueError(
            f"The {WEIGHTS} of {source} holds a tensor {bad} {what}, which `nag-lightning export` "
            "never writes; export the checkpoint again."
        )
    return weights


def _read_tokenizer(file: Path, spec: str, source: str | Path) -> dict:
    """The tokenizer entry of a checkpoint (`Tokenizer.saved()`), from tokenizer.json; for bytes,
    the file must stand for the bytes tokenizer (each id the byte of its value)."""
    text = file.read_text(encoding="utf-8", errors="replace")
    try:
        hf = HFTokenizer(text, str(file))
    except ValueError as error:
        raise ValueError(
            f"The {TOKENIZER} of {source} is not a tokenizer the `tokenizers` library reads "
            f"({str(error).split(' (')[-1].split(');')[0][:120]}); export the checkpoint again."
        ) from None
    if spec != BYTES:
        return {"spec": spec, "json": text}
    if hf.vocab_size != 256 or hf.token_bytes != Tokenizer().token_bytes:
        raise ValueError(
            f"The {TOKENIZER} of {source} does not stand for bytes, as its {CONFIG} says "
            "(tokenizer.spec: bytes); export the checkpoint again."
        )
    return {"spec": BYTES}


def settings_json(config: dict, source: str) -> str:
    """The folder's config.json text of `config`, settings read from the checkpoint `source`;
    one sentence for a setting JSON cannot write."""
    try:
        return json.dumps(config, indent=2, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"The checkpoint {source} holds settings that JSON cannot write ({error}); give a "
            "checkpoint written by `nag-lightning fit`."
        ) from None
