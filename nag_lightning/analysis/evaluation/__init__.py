"""A checkpoint at work: `checkpoint` (its bits per byte on its data), `generate` (continuing a prompt),
`lm_eval_model` and `lm_eval_command` (lm-evaluation-harness tasks, `nag-lightning eval`)."""
