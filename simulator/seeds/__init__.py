"""paraflex.simulator.seeds: the seed systems (Aegaeon, Prism, MuxServe) as simulated systems.

Place in the data flow: `layouts.py` registers `aegaeon`, `prism` and `muxserve` in the
simulator's SYSTEMS registry; each builds a `SystemLayout` whose `seed` names its simulated
cluster (`aegaeon_cluster.py` for prefill/decode pools with model switching,
`colocated_cluster.py` for models sharing a GPU by time slicing). runner.py builds that cluster
instead of the ParaFlex pipeline cluster; the workload generator, the metrics store, the cost
model and the event loop are the simulator's own. One decision per file: grouped FCFS
(`grouped_fcfs.py`), the WRR quota (`wrr_quota.py`), decode work lists (`decode_worklist.py`),
switch and activation costs (`switching.py`), KVPR placement (`kvpr.py`), Moore-Hodgson
admission (`moore_hodgson.py`), MuxServe's greedy placement (`muxserve_placement.py`), Prism's
idle eviction (`idle_eviction.py`).
"""
