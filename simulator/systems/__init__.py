"""paraflex.simulator.systems: the serving systems the simulator compares (layout + policy) and the ablations."""
