"""A trained model as a folder other tools read: weights in safetensors, settings in JSON.

`nag-lightning export --ckpt_path CKPT --out DIR` writes

    DIR/model.safetensors   the Transformer's weights (its state dict, without the module's prefix)
    DIR/config.json         the architecture (`TransformerConfig`: widths, depth, the residual and
                            router names and options), the module's other settings, the plugins'
                            saved settings (their `_extra_state`), the data settings and the step
    DIR/tokenizer.json      the tokenizer: the Hugging Face tokenizer.json of a BPE or of a file,
                            and for bytes a byte-level tokenizer.json whose ids are the byte values

`--format hf` writes a Hugging Face transformers folder instead (`nag_lightning.hf.writing`, the
extra `hf`): a Llama checkpoint for a pre-norm model without a router, else the model type
nag_lightning that `import nag_lightning.hf` registers; `nag_lightning.hf.read_hf` reads it back.

Reading DIR (`nag_lightning.checkpoints.exported.read_exported`) parses JSON and safetensors only,
never a pickle, into the same
dict a checkpoint holds, so `nag_lightning.checkpoints.reader.read_saved` hands every command one
`SavedCheckpoint` whichever was given, and the checks of checkpoints apply unchanged: plugin names
resolve through the registries only (`nag_lightning.checkpoints.trust`), weights must fit the model the
settings describe, the tokenizer must fit its vocabulary. A folder holds no optimizer or loop
state: `fit` starts from its weights with `--model.init_weights DIR`, and cannot resume it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal

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
    settings_json,
)
from nag_lightning.data.tokenizer_json import tokenizer_json
from nag_lightning.inputs import output_folder

FORMATS = (FORMAT, "hf")
"""What `export --format` writes: the package's own folder (`FORMAT`), or a Hugging Face
transformers folder (`nag_lightning.hf.writing`, the extra `hf`)."""


def export(saved, out: str | Path, format: str = FORMAT) -> Path:
    """Write the checkpoint `saved` (a `SavedCheckpoint`, its plugins and weights checked by the
    caller) as a folder `out` of one of `FORMATS`, which must not exist or be empty. The files are
    written into a folder beside it and moved into place at the end: a failed export leaves
    nothing behind."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"--out {out} already exists and is not an empty folder; give a new folder, so that "
            "nothing in it is overwritten."
        )
    write = _writer(format)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(saved, staging)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _writer(format: str):
    """The function that writes a folder of `format` into an empty folder."""
    if format == FORMAT:
        return write_files
    if format != "hf":
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}; got {format!r}.")
    try:
        from nag_lightning.hf.writing import write_hf_files
    except ModuleNotFoundError as error:
        if error.name != "transformers":
            raise
        raise ValueError(
            "--format hf needs Hugging Face transformers; install the extra with "
            "`pip install 'nag-lightning[hf]'`."
        ) from None
    return write_hf_files


def write_files(saved, folder: Path) -> list[str]:
    """The package's own folder of `saved` into the empty `folder`: safetensors weights,
    config.json, tokenizer.json. Returns the files' names."""
    from safetensors.torch import save_file

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
    text = settings_json(config, saved.source)
    save_file(weights, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(text, encoding="utf-8")
    (folder / TOKENIZER).write_text(tokenizer_json(saved.tokenizer), encoding="utf-8")
    return [WEIGHTS, CONFIG, TOKENIZER]




def export_checkpoint(
    ckpt_path: str, out: str, trust_checkpoint: bool = False, format: Literal["nag-lightning", "hf"] = FORMAT
) -> Path:
    """Write a checkpoint's model as a folder: safetensors weights, config.json, tokenizer.json.

    Args:
        ckpt_path: a .ckpt file written by `nag-lightning fit` (or a folder of `export`).
        out: the folder to write; it must not exist yet, or be empty.
        trust_checkpoint: let a residual or router named by a class path outside the registered
            plugins be built to check the weights; the folder names it as the checkpoint does,
            and loading it asks again.
        format: "nag-lightning", the package's own folder, which every command takes as a
            checkpoint; or "hf", a Hugging Face transformers folder (the extra `hf`): a Llama
            checkpoint for a pre-norm model without a router, else the model type nag_lightning,
            which transformers loads after `import nag_lightning.hf`.
    """
    from nag_lightning.checkpoints.loading import load_model

    output_folder(out, "--out")  # before the checkpoint is read: one that cannot be written ends here
    # every check of a model that runs, so the folder holds one: each weight fits, none is missing
    return export(load_model(ckpt_path, trust_checkpoint=trust_checkpoint).saved, out, format)


def export_command(args: list[str]) -> None:
    """`nag-lightning export`: a checkpoint's model as safetensors, config.json, tokenizer.json."""
    from nag_lightning.arguments import function_parser

    options = function_parser(export_checkpoint, "nag-lightning export").parse_args(args)
    out = export_checkpoint(**options.as_dict())
    print("wrote " + ", ".join(str(out / name) for name in sorted(os.listdir(out))))
