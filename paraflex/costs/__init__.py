"""paraflex.costs: devices, measured profile tables and the cost model that predicts stage times for the planner, the simulator and the benchmarks."""
