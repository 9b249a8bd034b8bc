"""paraflex.csrc: C sources of the engine's compiled CPU kernels (package data, no Python).

Place in the data flow: `paraflex.engine.native_attention` reads `paged_decode_attention.c` from
here at run time, compiles it once per machine and calls it from the attention layers.
"""
