"""Kernels behind the worker: Triton GPU kernels and CUDA graphs of decode steps."""
