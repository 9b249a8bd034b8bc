"""paraflex.engine: the autonomous execution engine. Pure core (KV block accounting, request
states, local scheduler, messages) shared with the simulator, plus the torch worker, the
transports and the engine loop at the edges."""
