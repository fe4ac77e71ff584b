"""A trained model as a folder other tools read: weights in safetensors, settings in JSON.

`nag-lightning export --ckpt_path CKPT --out DIR` writes

    DIR/model.safetensors   the Transformer's weights (its state dict, without the module's prefix)
    DIR/config.json         the architecture (`TransformerConfig`: widths, depth, the residual and
                            router names and options), the module's other settings, the plugins'
                            saved settings (their `_extra_state`), the data settings and the step
    DIR/tokenizer.json      the tokenizer: the Hugging Face tokenizer.json of a BPE or of a file,
                            and for bytes a byte-level tokenizer.json whose ids are the byte values

Reading DIR (`read_exported`) parses JSON and safetensors only, never a pickle, into the same
dict a checkpoint holds, so `nag_lightning.checkpoints.reader.read_saved` hands every command one
`SavedCheckpoint` whichever was given, and the checks of checkpoints apply unchanged: plugin names
resolve through the registries only (`nag_lightning.checkpoints.trust`), weights must fit the model the
settings describe, the tokenizer must fit its vocabulary. A folder holds no optimizer or loop
state: `fit` starts from its weights with `--model.init_weights DIR`, and cannot resume it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from importlib.metadata import version
from pathlib import Path

import torch

from nag_lightning.data.tokenizer import BYTES, HFTokenizer, Tokenizer, _bytes_to_unicode
from nag_lightning.inputs import output_folder, shorten

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


def export(saved, out: str | Path) -> Path:
    """Write the checkpoint `saved` (a `SavedCheckpoint`, its plugins and weights checked by the
    caller) as a folder `out`, which must not exist or be empty. The files are written into a
    folder beside it and moved into place at the end: a failed export leaves nothing behind."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"--out {out} already exists and is not an empty folder; give a new folder, so that "
            "nothing in it is overwritten."
        )
    weights, extra = {}, {}
    for name, value in saved.model_weights.items():
        if name.endswith(EXTRA_STATE):
            extra[name] = value
        else:  # a copy of its own: safetensors refuses tensors that share memory
            weights[name] = value.detach().to("cpu").contiguous().clone()
    config = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "arch": saved.arch,
        # Lightning's own entries (`_instantiator`, `_class_path`) name code; no reader needs them
        "module": {k: v for k, v in saved.settings.items() if k != "arch" and not k.startswith("_")},
        "extra_state": extra,
        "tokenizer": {"spec": saved.tokenizer.spec},
        "data": saved.data,
        "global_step": saved.global_step,
    }
    text = _json_text(config, saved.source)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        save_file(weights, str(staging / WEIGHTS), metadata={"format": "pt"})
        (staging / CONFIG).write_text(text, encoding="utf-8")
        (staging / TOKENIZER).write_text(tokenizer_json(saved.tokenizer), encoding="utf-8")
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _json_text(config: dict, source: str) -> str:
    try:
        return json.dumps(config, indent=2, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"The checkpoint {source} holds settings that JSON cannot write ({error}); give a "
            "checkpoint written by `nag-lightning fit`."
        ) from None


def tokenizer_json(tokenizer: Tokenizer) -> str:
    """A tokenizer.json for `tokenizer`: a Hugging Face tokenizer's own text, and for bytes a
    byte-level BPE without merges whose id of each byte is its value (GPT-2's byte alphabet)."""
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer.json_text
    from tokenizers import Tokenizer as _Tokenizer
    from tokenizers import decoders, models, pre_tokenizers

    table = _bytes_to_unicode()
    hf = _Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    return hf.to_str()


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


def export_checkpoint(ckpt_path: str, out: str, trust_checkpoint: bool = False) -> Path:
    """Write a checkpoint's model as a folder: safetensors weights, config.json, tokenizer.json.

    Args:
        ckpt_path: a .ckpt file written by `nag-lightning fit` (or a folder of `export`).
        out: the folder to write; it must not exist yet, or be empty.
        trust_checkpoint: let a residual or router named by a class path outside the registered
            plugins be built to check the weights; the folder names it as the checkpoint does,
            and loading it asks again.
    """
    from nag_lightning.checkpoints.reader import read_saved

    output_folder(out, "--out")  # before the checkpoint is read: one that cannot be written ends here
    saved = read_saved(ckpt_path)
    saved.check_plugins(trust_checkpoint)
    saved.transformer()  # every weight fits the model the settings describe, none is missing
    return export(saved, out)


def export_command(args: list[str]) -> None:
    """`nag-lightning export`: a checkpoint's model as safetensors, config.json, tokenizer.json."""
    from nag_lightning.cli import function_parser

    options = function_parser(export_checkpoint, "nag-lightning export").parse_args(args)
    out = export_checkpoint(**options.as_dict())
    print(f"wrote {out / WEIGHTS}, {out / CONFIG} and {out / TOKENIZER}")
