"""The architecture of the model, `TransformerConfig` (`model.arch` in YAML and on the command line):
every setting written in one place and validated with a sentence that says how to fix it."""

from __future__ import annotations

from dataclasses import dataclass, field

from nag_lightning.model.limits import check_size

SUBLAYER_KINDS = ("attn", "mlp")  # the sublayers of every block, in order


RESUMABLE_CHANGES = ("seq_len", "residual_options", "router_options", "router_options_by_kind", "init_std",
                     "embed_std", "rope_base", "activation_checkpointing")
"""The settings a run may resume with changed: the checkpoint's weights fit either way."""


@dataclass
class TransformerConfig:
    """Architecture of the model: `model.arch` in YAML and on the command line, the one place its
    settings are written. Every field is validated with a sentence that says how to fix it.

    Attributes:
        vocab_size: number of token ids (256 for bytes); the command line sets it from
            data.tokenizer.
        d_model: residual width C.
        n_layers: number of blocks (each an attention and an MLP sublayer).
        n_heads: attention heads; must divide d_model.
        mlp_ratio: SwiGLU hidden width over d_model.
        seq_len: longest sequence the rotary tables cover (the data module reads the same value).
        residual: residual strategy: "nag", "prenorm", another registered name, or the dotted
            class path of a strategy in any importable module.
        residual_options: keyword options of the residual strategy (e.g. theta_max, kernel).
        router: router: "none", "topk", "threshold", another registered name, or the dotted class
            path of a router in any importable module.
        router_options: keyword options of the router (e.g. capacity, tau, target_rate).
        router_options_by_kind: router options that differ by sublayer kind, e.g. {attn:
            {target_rate: 0.25}, mlp: {target_rate: 0.75}} for a 50% MoD rate that skips MLPs more
            often than attention: each kind's mapping overrides router_options in the routers of
            that kind's sublayers. A kind named here must be routed (route_kinds).
        route_kinds: which sublayer kinds are routed: "attn", "mlp" or both.
        route_layers: which blocks are routed: "all", "every_other" (1, 3, 5, ...), "inner" (all
            but the first and the last) or a list of block indices.
        attend_skipped: in a routed attention sublayer, tokens that skip it still offer their key
            and value (from their state as it is), so executed tokens can read every earlier
            token; a skipped token then costs the key and value projections, half of attention's.
            False: a skipped token is invisible to that sublayer (Mixture-of-Depths as published).
        init_std: standard deviation of linear weights at init; null means 1/sqrt(d_model). GPT-2's
            0.02 suits width 768; at width 64 it is 6x too small, and both residuals trained 0.3-0.55
            bits per byte worse under it (docs/results_history.md, section 0).
        embed_std: standard deviation of the token embedding at init.
        rope_base: rotary embedding base.
        activation_checkpointing: keep only each block's input in training and run its forward
            again during backward (`torch.utils.checkpoint`), trading that compute for the
            activation memory of every block.
    """

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: float = 4.0
    seq_len: int = 256
    residual: str = "nag"
    residual_options: dict = field(default_factory=dict)
    router: str = "none"
    router_options: dict = field(default_factory=dict)
    router_options_by_kind: dict = field(default_factory=dict)
    route_kinds: list[str] = field(default_factory=lambda: list(SUBLAYER_KINDS))
    route_layers: str | list[int] = "all"
    attend_skipped: bool = False
    init_std: float | None = None
    embed_std: float = 1.0
    rope_base: float = 10000.0
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        check_size(self)  # before anything is built: sizes from a file may be any number
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.arch.{name} must be at least 1; got {getattr(self, name)}.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"model.arch.d_model ({self.d_model}) must be divisible by model.arch.n_heads "
                f"({self.n_heads}); change one of them."
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"The head width d_model / n_heads = {self.d_model // self.n_heads} must be even "
                "for rotary embeddings; change model.arch.d_model or model.arch.n_heads."
            )
        if self.seq_len < 2:
            raise ValueError(
                f"model.arch.seq_len must be at least 2 (one input and one target); got {self.seq_len}."
            )
        if self.init_std is not None and self.init_std <= 0:
            raise ValueError(
                f"model.arch.init_std must be positive, or null for 1/sqrt(d_model); got {self.init_std}."
            )
        if self.mlp_ratio <= 0:
            raise ValueError(f"model.arch.mlp_ratio must be positive; got {self.mlp_ratio}.")
        if not self.rope_base > 0:
            raise ValueError(f"model.arch.rope_base must be positive (10000 is usual); got {self.rope_base}.")
        for kind in ("residual", "router"):
            if not isinstance(getattr(self, kind), str):
                raise ValueError(
                    f"model.arch.{kind} is a registered name or a dotted class path, with its options "
                    f"in model.arch.{kind}_options; got {getattr(self, kind)!r}."
                )
        unknown = set(self.route_kinds) - set(SUBLAYER_KINDS)
        if unknown:
            raise ValueError(
                f"model.arch.route_kinds names sublayer kinds {sorted(unknown)} that do not exist; "
                f"choose from {list(SUBLAYER_KINDS)}."
            )
        self.routed_layers()  # validates route_layers
        for kind, options in self.router_options_by_kind.items():
            if kind not in self.route_kinds:
                raise ValueError(
                    f"model.arch.router_options_by_kind sets options for {kind!r} sublayers, which "
                    f"route_kinds {self.route_kinds} does not route; route them, or drop the entry."
                )
            if not isinstance(options, dict):
                raise ValueError(
                    f"model.arch.router_options_by_kind.{kind} must be a mapping of router options "
                    f"(e.g. {{target_rate: 0.25}}); got {options!r}."
                )

    @property
    def n_sublayers(self) -> int:
        return 2 * self.n_layers

    @property
    def sublayer_kinds(self) -> list[str]:
        """The kind of every sublayer in order: block index // 2, attention first."""
        return list(SUBLAYER_KINDS) * self.n_layers

    @property
    def mlp_hidden(self) -> int:
        """The SwiGLU hidden width H."""
        return int(self.mlp_ratio * self.d_model)

    def routed_layers(self) -> set[int]:
        """The block indices whose sublayers of `route_kinds` are routed."""
        if self.route_layers == "all":
            return set(range(self.n_layers))
        if self.route_layers == "every_other":
            return set(range(1, self.n_layers, 2))
        if self.route_layers == "inner":  # the first and last blocks run every token
            return set(range(1, self.n_layers - 1))
        if isinstance(self.route_layers, str) or any(
            not 0 <= i < self.n_layers for i in self.route_layers
        ):
            raise ValueError(
                "model.arch.route_layers must be 'all', 'every_other', 'inner' or a list of block "
                f"indices in [0, {self.n_layers}); got {self.route_layers!r}."
            )
        return set(self.route_layers)

    def router_options_of(self, index: int) -> dict:
        """The router options of sublayer `index`: router_options, overridden by its kind's."""
        return {**self.router_options, **self.router_options_by_kind.get(self.sublayer_kinds[index], {})}

    def is_routed(self, index: int) -> bool:
        """Whether sublayer `index` (block index // 2, attention first) gets the router."""
        return index // 2 in self.routed_layers() and self.sublayer_kinds[index] in self.route_kinds
