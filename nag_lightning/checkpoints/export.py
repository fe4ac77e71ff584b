"""A trained model as a folder other tools read: weights in safetensors, settings in JSON.

`nag-lightning export --ckpt_path CKPT --out DIR` writes

    DIR/model.safetensors   the Transformer's weights (its state dict, without the module's prefix)
    DIR/config.json         the architecture (`TransformerConfig`: widths, depth, the residual and
                            router names and options), the module's other settings, the plugins'
                            saved settings (their `_extra_state`), the data settings and the step
    DIR/tokenizer.json      the tokenizer: the Hugging Face tokenizer.json of a BPE or of a file,
                            and for bytes a byte-level tokenizer.json whose ids are the byte values

Reading DIR (`nag_lightning.checkpoints.exported.read_exported`) parses JSON and safetensors only,
never a pickle, into the same
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
from pathlib import Path

from nag_lightning.checkpoints.exported import (  # noqa: F401 - the format's names, importable here as before
    CONFIG,
    EXTRA_STATE,
    FORMAT,
    FORMAT_VERSION,
    MODEL_PREFIX,
    TOKENIZER,
    WEIGHTS,
    is_exported,
    read_exported,
)
from nag_lightning.data.tokenizer import HFTokenizer, Tokenizer, _bytes_to_unicode
from nag_lightning.inputs import output_folder


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


def export_checkpoint(ckpt_path: str, out: str, trust_checkpoint: bool = False) -> Path:
    """Write a checkpoint's model as a folder: safetensors weights, config.json, tokenizer.json.

    Args:
        ckpt_path: a .ckpt file written by `nag-lightning fit` (or a folder of `export`).
        out: the folder to write; it must not exist yet, or be empty.
        trust_checkpoint: let a residual or router named by a class path outside the registered
            plugins be built to check the weights; the folder names it as the checkpoint does,
            and loading it asks again.
    """
    from nag_lightning.checkpoints.loading import load_model

    output_folder(out, "--out")  # before the checkpoint is read: one that cannot be written ends here
    # every check of a model that runs, so the folder holds one: each weight fits, none is missing
    return export(load_model(ckpt_path, trust_checkpoint=trust_checkpoint).saved, out)


def export_command(args: list[str]) -> None:
    """`nag-lightning export`: a checkpoint's model as safetensors, config.json, tokenizer.json."""
    from nag_lightning.arguments import function_parser

    options = function_parser(export_checkpoint, "nag-lightning export").parse_args(args)
    out = export_checkpoint(**options.as_dict())
    print(f"wrote {out / WEIGHTS}, {out / CONFIG} and {out / TOKENIZER}")
