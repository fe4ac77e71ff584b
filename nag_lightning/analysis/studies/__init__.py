"""Studies: experiments of many `fit` runs, cached by their settings (`study`), one file per study:
`depth`, `isoflop`, `tradeoff`, `tasks` and `tradeoff_tasks` (`nag-lightning study NAME`)."""
