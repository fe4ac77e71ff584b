"""A checkpoint's model as a Hugging Face transformers folder (`nag-lightning export --format hf`):

    config.json             a Llama config for a pre-norm model without a router, which plain
                            transformers reads (`LlamaForCausalLM`); for every other model the
                            model type nag_lightning (`NagLightningConfig`), which transformers
                            reads after `import nag_lightning.hf`
    model.safetensors       the weights, in Llama's names (`nag_lightning.hf.llama`) or in the
                            package's own under `model.` (`NagLightningForCausalLM.model`)
    tokenizer.json          the tokenizer, and tokenizer_config.json to read it as
    tokenizer_config.json   `PreTrainedTokenizerFast` (`nag_lightning.hf.tokenizer_files`)

Nothing in the folder is code, and nothing is a pickle: JSON and safetensors only.
"""

from __future__ import annotations

from pathlib import Path

from nag_lightning.checkpoints.exported import CONFIG, EXTRA_STATE, WEIGHTS, settings_json
from nag_lightning.hf.configuration import NagLightningConfig
from nag_lightning.hf.llama import is_llama_expressible, llama_config, to_llama
from nag_lightning.hf.modeling import NagLightningForCausalLM
from nag_lightning.hf.tokenizer_files import write_tokenizer
from nag_lightning.model import TransformerConfig


def write_hf_files(saved, folder: Path) -> list[str]:
    """Write the model of `saved` (a `SavedCheckpoint`, its plugins and weights checked by the
    caller) into the empty folder `folder` as a transformers folder; returns the files' names."""
    from safetensors.torch import save_file

    cfg = TransformerConfig(**saved.arch)
    weights = {k: v for k, v in saved.model_weights.items() if not k.endswith(EXTRA_STATE)}
    if is_llama_expressible(cfg):
        config, weights = llama_config(cfg), to_llama(weights, cfg)
    else:
        config = NagLightningConfig(
            arch=saved.arch,
            extra_state={k: v for k, v in saved.model_weights.items() if k.endswith(EXTRA_STATE)},
            tokenizer_spec=saved.tokenizer.spec,
            tokenizer_key=saved.tokenizer.key,
            architectures=[NagLightningForCausalLM.__name__],
        ).to_dict()
        # a copy of its own: safetensors refuses tensors that share memory
        prefix = NagLightningForCausalLM.base_model_prefix
        weights = {f"{prefix}.{k}": v.detach().to("cpu").contiguous().clone() for k, v in weights.items()}
    text = settings_json(config, saved.source)
    save_file(weights, str(folder / WEIGHTS), metadata={"format": "pt"})
    (folder / CONFIG).write_text(text, encoding="utf-8")
    write_tokenizer(saved.tokenizer, folder, cfg.seq_len)
    return sorted(p.name for p in folder.iterdir())
