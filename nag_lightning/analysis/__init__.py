"""Analysis around training: studies, post-training sweeps, generation, run comparison."""
