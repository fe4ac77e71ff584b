"""`nag-lightning depth-map`: a text's tokens against the model's sublayers, each cell coloured by
the angle the sublayer turned the token by, a skipped sublayer hatched grey (a `DepthMap`,
`analysis.evaluation.token_depth`), as a PNG.

    sublayer   ┌───────────────────────────────┐
    1.mlp      │ ▓ ░ ▒ ╱ ▓ ...                 │  bound 10.2°   (NaN: the residual has none)
    1.attn     │ ░ ╱ ▓ ▒ ░ ...                 │  bound 14.4°
    0.mlp      │ ...                           │
    0.attn     │ ...                           │
               └───────────────────────────────┘
                 d  e  f  ␣  m  a ...   tokens    colour: angle in degrees; ╱: skipped
"""

from __future__ import annotations

import math
from pathlib import Path

from nag_lightning.analysis.checks import check_device
from nag_lightning.analysis.evaluation.generate import use_causal_routing
from nag_lightning.analysis.evaluation.token_depth import DepthMap, depth_map
from nag_lightning.analysis.reports.plotting import pyplot, save
from nag_lightning.checkpoints.loading import load_model
from nag_lightning.inputs import output_folder

VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}
"""How whitespace shows as a tick label, where it would otherwise be an empty column."""


def visible(token: str) -> str:
    """A token as a tick label: whitespace as a visible sign."""
    return "".join(VISIBLE.get(c, c) for c in token)


def draw_depth_map(depth: DepthMap, path: Path, title: str = "") -> Path:
    """Write `depth` as a PNG at `path`: tokens across, sublayers up (the first at the bottom),
    colour the angle in degrees, skipped cells hatched on grey, each sublayer's bound at its right."""
    plt = pyplot()
    from matplotlib.patches import Rectangle

    T, S = depth.angle.shape
    degrees = depth.angle.T.double().rad2deg().masked_fill(~depth.executed.T, math.nan).numpy()  # (S, T)
    fig, ax = plt.subplots(figsize=(min(max(6.0, 0.28 * T + 2.5), 40.0), 0.42 * S + 1.8))
    cmap = plt.get_cmap("viridis").copy()
    cmap.set_bad("#d9d9d9")
    image = ax.imshow(degrees, cmap=cmap, aspect="auto", origin="lower", interpolation="nearest")
    for s, t in zip(*(~depth.executed.T).nonzero(as_tuple=True)):
        ax.add_patch(Rectangle((t - 0.5, s - 0.5), 1, 1, fill=False, hatch="///", edgecolor="#8c8c8c",
                               linewidth=0))
    ax.set_xticks(range(T), [visible(token) for token in depth.tokens], fontfamily="monospace",
                  rotation=0 if all(len(token) <= 1 for token in depth.tokens) else 90)
    ax.set_yticks(range(S), depth.sublayers)
    ax.set_xlabel("token")
    ax.set_ylabel("sublayer (block.kind)")
    bounds = depth.bound.tolist()
    if not all(math.isnan(b) for b in bounds):
        right = ax.secondary_yaxis("right")
        right.set_yticks(range(S), [f"≤ {math.degrees(b):.1f}°" for b in bounds])
    bar = fig.colorbar(image, ax=ax, pad=0.08 if not all(map(math.isnan, bounds)) else 0.02)
    bar.set_label("angle turned (degrees)")
    skipped = f", {100 * depth.mod_rate:.0f}% of sublayer runs skipped (hatched)" if depth.mod_rate else ""
    ax.set_title(f"{title}{skipped}", fontsize=10)
    return save(fig, path)


def depth_map_figure(ckpt_path: str, text: str, out: str = "depth_map.png", device: str = "cpu",
                     trust_checkpoint: bool = False) -> Path:
    """Draw how far each token of a text turns in each sublayer, and which sublayers it skips.

    Args:
        ckpt_path: a .ckpt file written by `nag-lightning fit`, or a folder of `nag-lightning export`.
        text: the text to map; it must fit the model's context (model.arch.seq_len tokens).
        out: the PNG to write.
        device: where to run ("cpu", "cuda").
        trust_checkpoint: let the checkpoint's residual or router import and call a class path
            outside the registered plugins; only for checkpoints whose origin you trust.
    """
    check_device(device)
    if not out.endswith(".png"):
        raise ValueError(f"--out {out} does not end in .png; give the path of the PNG to write.")
    output_folder(str(Path(out).parent), "--out")  # before the model is read
    loaded = load_model(ckpt_path, device, trust_checkpoint)
    use_causal_routing(loaded.model)  # route as generation does
    depth = depth_map(loaded.model, loaded.tokenizer, text)
    cfg = loaded.model.cfg
    title = f"residual {cfg.residual}, router {cfg.router}"
    return draw_depth_map(depth, Path(out), title)


def depth_map_command(args: list[str]) -> None:
    """`nag-lightning depth-map`: a text's tokens against the sublayers, coloured by angle."""
    from nag_lightning.arguments import function_parser

    options = function_parser(depth_map_figure, "nag-lightning depth-map").parse_args(args)
    print(f"wrote {depth_map_figure(**options.as_dict())}")
