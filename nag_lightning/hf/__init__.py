"""Hugging Face transformers for this package's models (the optional extra `hf`).

`nag-lightning export --format hf` writes a folder that `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` load (`writing`). A pre-norm model without a router is a
standard Llama checkpoint, which plain transformers reads with no code of this package (`llama`);
every other residual stream and router has the model type nag_lightning, whose config and model
classes (`NagLightningConfig`, `NagLightningForCausalLM`) importing this package registers with
`AutoConfig` and `AutoModelForCausalLM`. No `trust_remote_code`: nothing in a folder is code.

    import nag_lightning.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    model = AutoModelForCausalLM.from_pretrained("exported")      # Llama, or the package's own
    generate = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained("exported"))

`read_hf(path)` reads such a folder back into the package's `Transformer` and `Tokenizer`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from nag_lightning.hf.configuration import MODEL_TYPE, NagLightningConfig
from nag_lightning.hf.modeling import NagLightningForCausalLM
from nag_lightning.hf.reading import read_hf
from nag_lightning.hf.writing import write_hf_files

__all__ = ["MODEL_TYPE", "NagLightningConfig", "NagLightningForCausalLM", "read_hf", "write_hf_files"]

# exist_ok: importing twice (a reload, a second copy of the package) registers the same classes
AutoConfig.register(MODEL_TYPE, NagLightningConfig, exist_ok=True)
AutoModelForCausalLM.register(NagLightningConfig, NagLightningForCausalLM, exist_ok=True)
