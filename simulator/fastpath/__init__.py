"""paraflex.simulator.fastpath: exact bulk replays of steady decode phases (same results as step-by-step, fewer events), behind one hook (hook.py)."""
