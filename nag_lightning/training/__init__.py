"""Training runs: `module` (the LightningModule), `runs` (run folders, their locks and resumption),
`sharding` (FSDP2 wrapping) and `quiet` (the warnings a run does not need)."""
