"""Reports: `compare` (finished runs side by side), `depth` (the depth diagnostics figure of a run,
drawn from the data its callback wrote) and `plotting` (where every figure is started and saved)."""
