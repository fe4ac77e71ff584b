"""Analysis around training, grouped by what a user does: `studies` (experiments of many runs),
`sweeps` (a checkpoint's routing against compute), `evaluation` (a checkpoint on its data,
generation, lm-evaluation-harness) and `reports` (runs side by side, figures)."""
