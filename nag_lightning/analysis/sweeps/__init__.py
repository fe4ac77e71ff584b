"""Post-training sweeps of a checkpoint's routing: `sweep` (the command), `sweepable` (what the sweep asks
of a router), `probes` (routers fitted to a frozen model), `oracle` and `report` (its CSV and figure)."""
