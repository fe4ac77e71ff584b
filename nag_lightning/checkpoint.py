"""A trained `Transformer` out of a `nag-lightning fit` checkpoint, without Lightning.

Commands that only run the model (`generate`) load it here: importing Lightning takes seconds,
which a command that starts, writes a line and ends should not pay. The checkpoint is untrusted
input: it is read as `nag_lightning.trust` reads every checkpoint (`weights_only=True`, local or
remote), and a residual strategy or router it names by a class path outside the registries is
refused unless the user trusts the checkpoint (a class path would import any module).
"""

from __future__ import annotations

from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.saved_settings import saved_architecture
from nag_lightning.tokenizer import Tokenizer, load_saved
from nag_lightning.trust import check_plugins, read_checkpoint


def load_transformer(
    ckpt_path: str, device: str = "cpu", trust_checkpoint: bool = False
) -> tuple[Transformer, dict]:
    """The checkpoint's model, in eval mode on `device`, and its saved hyperparameters."""
    model, saved, _ = load_transformer_and_tokenizer(ckpt_path, device, trust_checkpoint)
    return model, saved


def load_transformer_and_tokenizer(
    ckpt_path: str, device: str = "cpu", trust_checkpoint: bool = False
) -> tuple[Transformer, dict, Tokenizer]:
    """`load_transformer`'s model and hyperparameters, and the tokenizer the checkpoint holds
    (bytes for a checkpoint written before tokenizers were saved)."""
    checkpoint = read_checkpoint(ckpt_path)
    check_plugins(checkpoint, ckpt_path, trust_checkpoint)
    saved = checkpoint.get("hyper_parameters")
    if not isinstance(saved, dict) or "state_dict" not in checkpoint:
        raise ValueError(
            f"{ckpt_path} is not a checkpoint of `nag-lightning fit` (no hyper_parameters or "
            "state_dict); give a .ckpt file from a run's checkpoints/ folder."
        )
    model = Transformer(TransformerConfig(**saved_architecture(saved)))
    prefix = "model."
    weights = {k[len(prefix):]: v for k, v in checkpoint["state_dict"].items() if k.startswith(prefix)}
    model.load_state_dict(weights)
    return model.to(device).eval(), saved, load_saved(checkpoint.get("tokenizer"))
