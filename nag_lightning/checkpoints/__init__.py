"""The one home of checkpoint reading: `loading` (`load_model`, a ready model and its tokenizer
from a checkpoint or an export, every check done, which everything that runs a trained model
calls), `reader` (`read_saved`, the one read of a file, handed around as a `SavedCheckpoint`),
`formats` (which kind of path it is), `trust` (what a checkpoint may name), `values` (what it
holds), `settings` (its saved hyper-parameters in the current layout) and `compat` (the formats of
earlier releases, and where their modules moved)."""
