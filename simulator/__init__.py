"""paraflex.simulator: discrete-event cluster simulator that drives the engine's own scheduler
and KV accounting against the cost model. Pure Python: no torch, Ray or HTTP imports."""
