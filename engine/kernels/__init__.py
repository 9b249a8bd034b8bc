"""paraflex.engine.kernels: compiled and GPU kernels behind the worker: bridges to the C kernels of paraflex.csrc (CPU) and the Triton kernels (GPU)."""
