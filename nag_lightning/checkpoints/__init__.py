"""The one home of checkpoint reading: `reader` (`read_saved`, the one read of a file, handed
around as a `SavedCheckpoint`), `trust` (what a checkpoint may name), `settings` (its saved
hyper-parameters in the current layout) and `compat` (the formats of earlier releases, and where
their modules moved)."""
