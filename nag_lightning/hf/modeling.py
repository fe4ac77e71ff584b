"""`NagLightningForCausalLM`: the package's own `Transformer` as a transformers causal LM, so that
`AutoModelForCausalLM`, `generate`, `pipeline("text-generation")` and lm-eval's `hf` model run
any residual stream and router of this package, built from `NagLightningConfig` through the
package's registries (never from code stored beside the weights).

    input_ids (B, T), attention_mask (B, T) ─> Transformer ─> logits (B, T, vocab)

Without padding the forward pass is the package's own (`Transformer.forward`), so the logits are
its logits. With padding (any zero in attention_mask, left or right) it is one pass of the
package's generation path over the real tokens only (`CachedPass` with empty caches): padding
runs no sublayer and writes no key or value, and each row's real tokens sit at positions 0, 1,
... as they would alone, so a prompt's logits do not depend on the other prompts of its batch.
That path needs every router to decide causally in eval mode, as the package's generation does.

`generate` recomputes the whole sequence at every step (no KV cache through transformers): the
simplest path whose every step is the package's forward pass, at the cost of speed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from nag_lightning.checkpoints.exported import EXTRA_STATE
from nag_lightning.hf.configuration import NagLightningConfig
from nag_lightning.model import Transformer, TransformerConfig
from nag_lightning.model.inference import CachedDecoder
from nag_lightning.model.kv_cache import CachedPass


class NagLightningForCausalLM(PreTrainedModel, GenerationMixin):
    """A `Transformer` of this package (`self.model`) behind transformers' causal-LM interface.

    Args:
        config: the model's settings (`NagLightningConfig`).
    """

    config_class = NagLightningConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"

    def __init__(self, config: NagLightningConfig) -> None:
        super().__init__(config)
        self.model = Transformer(config.transformer_config())
        self._load_saved_settings(self.model)
        # the settings as the plugins resolved them, so `save_pretrained` writes them too
        config.extra_state = {k: v for k, v in self.model.state_dict().items() if k.endswith(EXTRA_STATE)}
        # transformers builds a model it loads on the meta device and fills in the tensors the
        # folder holds; the ones the package computes as it builds a model (the rotary tables, a
        # router's rate: non-persistent buffers) come from a copy built on the CPU (`_init_weights`).
        self._loading = self.model.head.weight.is_meta
        self._computed = _computed_buffers(self.model.cfg) if self._loading else {}
        self.post_init()

    def _load_saved_settings(self, model: Transformer) -> None:
        """The plugins' saved settings (`extra_state`) into `model`, refused in one sentence."""
        try:
            model.load_state_dict(self.config.extra_state, strict=False)
        except (ValueError, RuntimeError, TypeError) as error:
            raise ValueError(
                f"The config's extra_state is refused by the model its arch describes "
                f"({str(error).strip()[:200]}); export the checkpoint again with `nag-lightning "
                "export --format hf`."
            ) from None

    def _init_weights(self, module: nn.Module) -> None:
        """After loading, for a `module` of the model with tensors the folder did not hold:
        the computed buffers take the values the package's construction gives them, and a missing
        weight is refused in one sentence (transformers would fill it with noise). A model built
        on a real device has initialized itself, and nothing is done."""
        if not self._loading:
            return
        prefix = next((name for name, m in self.model.named_modules() if m is module), None)
        if prefix is None:  # the wrapper itself: it holds nothing but the model
            return
        tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for name, tensor in tensors:
            full = f"{prefix}.{name}" if prefix else name
            if getattr(tensor, "_is_hf_initialized", False):
                continue
            if full not in self._computed:
                raise ValueError(
                    f"The folder {self.config.name_or_path} holds no weight "
                    f"{self.base_model_prefix}.{full}; give the complete folder `nag-lightning export "
                    "--format hf` wrote."
                )
            with torch.no_grad():
                tensor.copy_(self._computed[full])

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The tensors of the model, without the plugins' saved settings (`*._extra_state`, plain
        data): those travel in the config (`extra_state`), since safetensors holds tensors only,
        and transformers loads and saves every entry of the state dict as a tensor."""
        state = super().state_dict(*args, **kwargs)
        for name in [k for k in state if k.endswith(EXTRA_STATE)]:
            del state[name]
        return state

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.model.head

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        """input_ids (B, T), attention_mask (B, T) 1 on real tokens, labels (B, T) the ids to
        score (-100: none; shifted here, as transformers' causal LMs do) -> logits (B, T, vocab)
        and, with labels, the mean cross-entropy of the next token (without the routers' and the
        residual stream's auxiliary losses, which the package's training adds). Other keyword
        arguments of transformers' callers (caches, output options) do not apply and are ignored."""
        if attention_mask is None or bool(attention_mask.all()):
            logits = self.model(input_ids).logits
        else:
            logits = self._padded_logits(input_ids, attention_mask.bool())
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _padded_logits(self, input_ids: Tensor, real: Tensor) -> Tensor:
        """Logits (B, T, vocab) of the tokens `real` (B, T) marks, each row's at positions 0, 1, ...;
        rows of padding get logits too, which mean nothing."""
        if self.training:
            raise ValueError(
                "A padded batch runs through the package's generation path, which does not train; "
                "train on rows of equal length (no zeros in attention_mask), or call model.eval()."
            )
        longest, seq_len = int(real.sum(1).max()), self.model.cfg.seq_len
        if longest > seq_len:
            raise ValueError(
                f"The input has a row of {longest} tokens, more than the model's seq_len "
                f"(max_position_embeddings) = {seq_len}; shorten it."
            )
        decoder = CachedDecoder(self.model, input_ids.shape[0])  # refuses a router that is not causal
        positions = (real.cumsum(1) - 1).clamp_min(0)
        with torch.no_grad():
            state = self.model.stream(input_ids, CachedPass(decoder.caches, positions, real))
            return self.model.readout(state)

    def prepare_inputs_for_generation(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any
    ) -> dict[str, Tensor | None]:
        """Every step sees the whole sequence so far: there is no cache to continue from."""
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def _computed_buffers(cfg: TransformerConfig) -> dict[str, Tensor]:
    """The buffers a `Transformer` of `cfg` computes as it is built and no state dict holds
    (non-persistent), by name, from a copy built on the CPU."""
    with torch.device("cpu"):
        fresh = Transformer(cfg)
    saved = fresh.state_dict().keys()
    return {name: buffer for name, buffer in fresh.named_buffers() if name not in saved}
