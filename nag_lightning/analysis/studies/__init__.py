"""Studies: experiments of many `fit` runs, cached by their settings (`study`), one file per study:
`depth`, `isoflop`, `tradeoff` and `tasks` (`nag-lightning study NAME`)."""
