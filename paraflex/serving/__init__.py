"""paraflex.serving: the serving frontend between the HTTP gateway and the engines.

One frontend (frontend.py: admission, dispatch over live replicas, end/abort/free, the KV-stall
watch, recompute restarts) over an engine-handle interface (engine_handle.py) with two
implementations: engines in this process (in_process_engines.py, driven by `LLMCluster` in
in_process.py, served by in_process_backend.py) and Ray engine actors (ray_engines.py, watched by
ray_monitor.py, served by ray_backend.py, started by ray_startup.py). The gateway reaches either
through the `Backend` protocol (backend.py).

`paraflex.serving.LLMCluster` is `paraflex.serving.in_process.LLMCluster`, imported on first use:
importing this package loads no torch or Ray.
"""


def __getattr__(name: str):
    if name == "LLMCluster":
        from paraflex.serving.in_process import LLMCluster

        return LLMCluster
    raise AttributeError(f"module 'paraflex.serving' has no attribute {name!r}")
