"""paraflex.simulator.core: the event machinery: the event loop, the event types, simulated engines and the simulated cluster."""
