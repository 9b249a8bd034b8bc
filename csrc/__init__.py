"""paraflex.csrc: C sources of the engine's compiled CPU kernels (package data, no Python).

Place in the data flow: `paraflex.engine.kernels.native_build` reads the C files from here at run time
and compiles each once per machine: `thread_pool.c` (the worker threads every kernel shares),
`linear_f32.c` (projections over packed weight panels), `paged_decode_attention.c` (decode
attention over the paged KV pool) and `decoder_layer_ops.c` (RMSNorm, rotation, SiLU · up,
greedy argmax), with the headers `vec_math.h`, `bf16.h` (bfloat16 storage) and `thread_pool.h`; `model/linear`,
`native_attention` and `native_ops` call them.
"""
