"""A pre-norm model without a router is a Llama model: its settings and weights in Llama's names,
both ways, so plain `transformers` (`LlamaForCausalLM`) computes the package's logits, and a Llama
folder whose settings the package can express reads back into a `Transformer`.

What maps to what, per block l (C = d_model, H = the MLP's hidden width, D = head width):

    embed.weight                          model.embed_tokens.weight
    strategy.gamma[2l], gamma[2l + 1]     model.layers.l.input_layernorm / post_attention_layernorm
    attn qkv.weight (3C, C)               self_attn.q_proj, k_proj, v_proj (C, C) each; q and k
                                          rows permuted within each head (RoPE pairs, below)
    attn proj.weight                      self_attn.o_proj.weight
    mlp gate_up.weight (2H, C)            mlp.gate_proj (first H rows), mlp.up_proj (last H)
    mlp proj.weight                       mlp.down_proj.weight
    strategy.gamma_out                    model.norm.weight
    head.weight                           lm_head.weight (untied)

RoPE: the package rotates interleaved pairs of a head's channels, (0, 1), (2, 3), ..., pair i by
the i-th frequency; Llama rotates halves, channel i with channel i + D/2 (`rotate_half`). Listing a
head's query and key rows evens first, then odds, turns one into the other, and the scores q·k do
not change, since queries and keys are permuted alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from nag_lightning.model import TransformerConfig

LLAMA = "llama"
PRENORM_EPS = 1e-6  # the pre-norm residual's default RMSNorm epsilon (`PreNormResidual`)


def is_llama_expressible(cfg: TransformerConfig) -> bool:
    """Whether Llama computes the model `cfg` describes: the pre-norm stream (its only option
    being the RMSNorm epsilon) and no router."""
    return cfg.residual == "prenorm" and cfg.router == "none" and set(cfg.residual_options) <= {"eps"}


def llama_config(cfg: TransformerConfig) -> dict[str, Any]:
    """The config.json of `LlamaForCausalLM` for the model `cfg` describes. The RoPE base is
    written both as transformers 5 reads it (`rope_parameters`) and as earlier releases do."""
    head_dim = cfg.d_model // cfg.n_heads
    rope = {"rope_type": "default", "rope_theta": cfg.rope_base}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": LLAMA,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads, "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.seq_len,
        "rms_norm_eps": cfg.residual_options.get("eps", PRENORM_EPS),
        "rope_parameters": rope, "rope_theta": cfg.rope_base, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
        "tie_word_embeddings": False, "initializer_range": cfg.init_std or cfg.d_model**-0.5,
        # no special tokens: the package's tokenizers have none, and Llama's defaults (1 and 2)
        # would stop generation at byte 2
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
        "use_cache": True, "dtype": "float32", "torch_dtype": "float32",
    }


def rope_order(head_dim: int) -> Tensor:
    """The package's channel of each of Llama's channels in a head: evens, then odds."""
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


def _heads(weight: Tensor, n_heads: int, order: Tensor) -> Tensor:
    """Rows (H * D, C) of a query or key projection with each head's rows put in `order`."""
    return weight.unflatten(0, (n_heads, -1))[:, order].flatten(0, 1)


def to_llama(weights: Mapping[str, Tensor], cfg: TransformerConfig) -> dict[str, Tensor]:
    """The package's weights of a Llama-expressible model, in Llama's names and layout."""
    C, H, order = cfg.d_model, cfg.mlp_hidden, rope_order(cfg.d_model // cfg.n_heads)
    gamma = weights["strategy.gamma"]
    out = {"model.embed_tokens.weight": weights["embed.weight"],
           "model.norm.weight": weights["strategy.gamma_out"], "lm_head.weight": weights["head.weight"]}
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        q, k, v = weights[ours + "attn.compute.qkv.weight"].split(C)
        gate_up = weights[ours + "mlp.compute.gate_up.weight"]
        out |= {
            theirs + "input_layernorm.weight": gamma[2 * layer],
            theirs + "post_attention_layernorm.weight": gamma[2 * layer + 1],
            theirs + "self_attn.q_proj.weight": _heads(q, cfg.n_heads, order),
            theirs + "self_attn.k_proj.weight": _heads(k, cfg.n_heads, order),
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": weights[ours + "attn.compute.proj.weight"],
            theirs + "mlp.gate_proj.weight": gate_up[:H],
            theirs + "mlp.up_proj.weight": gate_up[H:],
            theirs + "mlp.down_proj.weight": weights[ours + "mlp.compute.proj.weight"],
        }
    return {name: value.detach().to("cpu").contiguous().clone() for name, value in out.items()}


def from_llama(weights: Mapping[str, Tensor], cfg: TransformerConfig, tied: bool) -> dict[str, Tensor]:
    """Llama's weights (`to_llama`'s names) as the package's, for the model `cfg` describes;
    `tied`: the folder has no lm_head and its head is the embedding. A weight that is missing
    raises KeyError with its Llama name."""
    inverse = torch.argsort(rope_order(cfg.d_model // cfg.n_heads))
    head = weights["model.embed_tokens.weight" if tied else "lm_head.weight"]
    out = {"embed.weight": weights["model.embed_tokens.weight"], "head.weight": head,
           "strategy.gamma_out": weights["model.norm.weight"]}
    gammas = []
    for layer in range(cfg.n_layers):
        ours, theirs = f"blocks.{layer}.", f"model.layers.{layer}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        gammas += [weights[theirs + "input_layernorm.weight"],
                   weights[theirs + "post_attention_layernorm.weight"]]
        out[ours + "attn.compute.qkv.weight"] = torch.cat((
            _heads(weights[attn + "q_proj.weight"], cfg.n_heads, inverse),
            _heads(weights[attn + "k_proj.weight"], cfg.n_heads, inverse),
            weights[attn + "v_proj.weight"],
        ))
        out[ours + "attn.compute.proj.weight"] = weights[attn + "o_proj.weight"]
        out[ours + "mlp.compute.gate_up.weight"] = torch.cat((weights[mlp + "gate_proj.weight"],
                                                             weights[mlp + "up_proj.weight"]))
        out[ours + "mlp.compute.proj.weight"] = weights[mlp + "down_proj.weight"]
    out["strategy.gamma"] = torch.stack(gammas)
    return out


def arch_from_llama(config: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The `TransformerConfig` settings of a Llama config.json (of the folder `source`); one
    sentence (ValueError) naming every setting the package's pre-norm model cannot express."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    sizes = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if not all(isinstance(config.get(k), int) and config[k] > 0 for k in sizes):
        raise ValueError(
            f"The Llama config of {source} lacks a positive whole vocab_size, hidden_size, "
            "intermediate_size, num_hidden_layers or num_attention_heads; give an undamaged config.json."
        )
    rope, scaling = (config.get(k) if isinstance(config.get(k), Mapping) else {}
                     for k in ("rope_parameters", "rope_scaling"))
    # transformers 5 names the RoPE settings rope_parameters, earlier releases rope_scaling
    rope_type = rope.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    mlp_ratio = config["intermediate_size"] / hidden
    if int(mlp_ratio * hidden) != config["intermediate_size"]:  # a rounding of the division
        mlp_ratio = math.nextafter(mlp_ratio, math.inf)
    problems = [
        text for text, unsupported in (
            (f"hidden_act {config.get('hidden_act')!r} (only silu)",
             config.get("hidden_act", "silu") != "silu"),
            ("attention_bias (the projections have no bias)", bool(config.get("attention_bias"))),
            ("mlp_bias (the projections have no bias)", bool(config.get("mlp_bias"))),
            (f"num_key_value_heads {config.get('num_key_value_heads')} below num_attention_heads {heads} "
             "(grouped-query attention)", config.get("num_key_value_heads") not in (None, heads)),
            (f"head_dim {config.get('head_dim')} with hidden_size {hidden} and {heads} heads (the heads "
             "split hidden_size)", config.get("head_dim") not in (None, hidden // heads)),
            (f"rope type {rope_type!r} (only the default RoPE)", rope_type != "default"),
            (f"intermediate_size {config['intermediate_size']} (not a width mlp_ratio * hidden_size "
             "gives)", int(mlp_ratio * hidden) != config["intermediate_size"]),
        ) if unsupported
    ]
    if problems:
        raise ValueError(
            f"The Llama model of {source} has settings this package's pre-norm model cannot express: "
            f"{', '.join(problems)}; give a Llama folder without them, e.g. one written by "
            "`nag-lightning export --format hf`."
        )
    return {
        "vocab_size": config["vocab_size"], "d_model": hidden, "n_layers": config["num_hidden_layers"],
        "n_heads": heads, "mlp_ratio": mlp_ratio, "seq_len": config.get("max_position_embeddings", 2048),
        "residual": "prenorm", "residual_options": {"eps": config.get("rms_norm_eps", PRENORM_EPS)},
        "rope_base": rope.get("rope_theta", config.get("rope_theta", 10000.0)),
    }
