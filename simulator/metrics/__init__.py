"""paraflex.simulator.metrics: per-request records, summaries and the files one simulation writes."""
