"""What routing did on the last forward pass: MoD rate, executed tokens, KV entries, router losses.

Every `Sublayer` keeps `executed_per_seq` (B,) after a forward; every router keeps its auxiliary loss
and `stats()`. `routing_stats` turns them into the numbers DESIGN section 4 asks each router to
report. The counting itself is `nag_lightning.model.flops`' (`count_model`: executed pairs, the MoD rate,
executed weights), so training logs, the sweep and the FLOP accounting read one definition:

    MoD rate = skipped (token, sublayer) executions / (tokens x sublayers of the WHOLE model)

so routing half the sublayers at a 25% rate per sublayer is a 12.5% MoD rate.
"""

from __future__ import annotations

from collections import defaultdict

from torch import nn

from nag_lightning.model.flops import count_model


def sublayer_label(sublayer: nn.Module) -> str:
    """'{block}_{kind}', e.g. '3_attn', the name sublayers are logged under."""
    return f"{sublayer.index // 2}_{sublayer.kind}"


def routing_stats(model: nn.Module, seq_len: int, per_sublayer: bool = True) -> dict[str, float]:
    """Routing numbers of the last forward pass of `model` (a `Transformer`) on sequences of
    `seq_len` tokens.

    Keys: `mod_rate` (whole model), `executed_tokens` ((token, sublayer) executions),
    `kv_entries` (keys/values written, all attention sublayers), `executed_param_fraction` (executed
    sublayer parameters per token over all of them), `aux_loss` (sum over routers), the mean of
    each router statistic over routed sublayers (e.g. `predictor_agreement`, `tau`), and with
    `per_sublayer` `mod_rate/{block}_{kind}` and `{statistic}/{block}_{kind}` for routed sublayers.
    """
    sublayers = model.sublayers
    if any(s.executed_per_seq is None for s in sublayers):
        raise ValueError("routing_stats needs a forward pass of the model first.")
    count = count_model(model, seq_len)
    stats: dict[str, float] = {
        "mod_rate": count.mod_rate,
        "executed_tokens": float(sum(s.executed for s in count.sublayers)),
        "kv_entries": float(sum(s.executed for s in count.sublayers if s.kind == "attn")),
        "executed_param_fraction": count.executed_param_fraction,
        "aux_loss": sum(float(s.router.aux_loss.detach()) for s in sublayers if s.routed),
    }
    pooled: dict[str, list[float]] = defaultdict(list)
    for counted, s in zip(count.sublayers, sublayers):
        if not s.routed:
            continue
        label = sublayer_label(s)
        router_stats = s.router.stats()
        for key, value in router_stats.items():
            pooled[key].append(value)
        if per_sublayer:
            stats[f"mod_rate/{label}"] = 1.0 - counted.executed / count.tokens
            stats.update({f"{key}/{label}": value for key, value in router_stats.items()})
    stats.update({key: sum(values) / len(values) for key, values in pooled.items()})
    return stats
