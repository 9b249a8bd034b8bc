"""paraflex.planner: sharding, replication (Alg. 1), DRF placement (Alg. 2), exact MILP and
baseline layouts. Input: models' stage counts, weights and demand; output: a `Placement`.
Pure Python: no torch, Ray or HTTP imports."""
