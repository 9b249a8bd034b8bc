"""paraflex.csrc: C sources of the engine's compiled CPU kernels (package data, no Python).

Place in the data flow: `paraflex.engine.native_build` reads `paged_decode_attention.c` (decode
attention over the paged KV pool) and `decoder_layer_ops.c` (RMSNorm, rotation, SiLU · up), with
the `vec_math.h` header they share, from here at run time and compiles each once per machine;
`native_attention` and `native_ops` call them from the layers.
"""
