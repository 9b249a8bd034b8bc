"""The compiled CPU attention kernels: load, call. Decode batches (csrc/paged_decode_attention.c)
and float32 batches with prompts (csrc/paged_prompt_attention.c).

Place in the data flow: `paged_attention` (engine/worker/attention.py) calls `decode_attention` for a
float32 or bfloat16 decode batch on CPU and `prompt_attention` for a float32 batch holding a prompt
(whole or a chunk after cached context); each kernel stores the new keys/values in the pool and
attends over each request's context where its blocks lie, instead of copying the whole context of
the batch into one tensor per layer (the torch path's cost on CPU). Built and loaded by
engine/kernels/native_build.py on first use (ctypes releases the GIL during the call);
PARAFLEX_NATIVE_ATTENTION=0, no compiler or a failed build leave the torch path in place.
bfloat16 prompts stay on the torch path (its rounding points are the reference for bf16 tokens).
"""

from __future__ import annotations

import ctypes

import torch

from paraflex.engine.kernels.native_build import THREAD_POOL, NativeLibrary


def _declare(lib: ctypes.CDLL) -> None:
    fn = lib.pf_paged_decode_attention
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32, ptr, i64, ptr, i64, ctypes.c_float, ptr, i32, i32]
    fn.restype = ctypes.c_int


LIBRARY = NativeLibrary("paged_decode_attention.c", "PARAFLEX_NATIVE_ATTENTION", "compiled CPU attention",
                        _declare, extra_flags=("-ffp-contract=fast",), depends=(THREAD_POOL,),
                        dtypes=(torch.float32, torch.bfloat16))


def _declare_prompts(lib: ctypes.CDLL) -> None:
    fn = lib.pf_paged_prompt_attention
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32, ptr, i64, ptr, ptr, i64, ctypes.c_float, ptr, i32]
    fn.restype = ctypes.c_int


PROMPT_LIBRARY = NativeLibrary("paged_prompt_attention.c", "PARAFLEX_NATIVE_ATTENTION", "compiled CPU prompt attention",
                               _declare_prompts, extra_flags=("-ffp-contract=fast",), depends=(THREAD_POOL,))


def load() -> ctypes.CDLL | None:
    """The loaded kernel, or None when it is off or cannot be built here (logged once)."""
    return LIBRARY.load()


def usable(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether this decode batch can take the kernel: queries and pool both float32 or both
    bfloat16 on CPU, head_dim a multiple of the kernel's vector width (8), kernel loaded."""
    return kv.dtype == q.dtype and q.shape[-1] % 8 == 0 and LIBRARY.serves(q.device, q.dtype)


def _run(fn, what: str, q, k, v, kv, block_table, context_lens, scale: float, *, query_start=None,
         flags: tuple[int, ...] = ()) -> torch.Tensor:
    """One kernel call with the arguments both kernels share (the new tokens' q/k/v, the pool's
    geometry, the layer's block table, the requests' context lengths, the scale, the output and
    the thread count); `query_start` (its pointer) and `flags` go where the kernel takes them."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads, tpb = k.shape[1], kv.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype)
    starts = () if query_start is None else (query_start.data_ptr(),)
    rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), kv.data_ptr(), kv.stride(0), kv.stride(1), tpb,
            kv_heads, num_heads // kv_heads, head_dim, block_table.data_ptr(), block_table.shape[1],
            context_lens.data_ptr(), *starts, context_lens.shape[0], scale, out.data_ptr(), *flags,
            torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"{what}: no memory for its scratch buffer")
    return out


def decode_attention(q, k, v, kv, block_table, context_lens, scale: float) -> torch.Tensor:
    """q [B, Hq, D], k/v [B, Hkv, D] (one new token per request), kv the model's pool view
    [blocks, 2, tpb, Hkv, D], block_table int64 [B, max_blocks] of this layer, context_lens int64
    [B] (including the new token). Writes k/v into the pool; returns [B, Hq * D]."""
    return _run(LIBRARY.lib.pf_paged_decode_attention, LIBRARY.what, q, k, v, kv, block_table, context_lens, scale,
                flags=(int(q.dtype == torch.bfloat16),))


# The prompt kernel's longest context. Per layer of SmolLM2's shape (9 query heads over 3 kv heads,
# head_dim 64), one prompt, 2 threads, on the 2-core AVX-512 VM: 128 tokens 0.28 ms against the
# torch path's 0.54-0.77 ms, 512 3.3 vs 4.5 ms, 768 and 1,024 level (7.4 vs 7.5, 13.2 vs 13.0 ms;
# the whole 1,024-token prefill 5% slower), 2,048 51 vs 41 ms: past ~500 tokens torch's blocked
# matrix products catch up (the kernel reaches ~45% of the FMA peak). Whole prefills: 128 tokens
# 1.07x, 512 1.03x faster.
PROMPT_KERNEL_MAX_CONTEXT = 512


def prompts_usable(q: torch.Tensor, kv: torch.Tensor, max_context: int) -> bool:
    """Whether a batch with prompts takes the prompt kernel: queries and pool float32 on CPU,
    head_dim a multiple of 8, no context longer than PROMPT_KERNEL_MAX_CONTEXT, kernel loaded."""
    return (kv.dtype == q.dtype and q.shape[-1] % 8 == 0 and max_context <= PROMPT_KERNEL_MAX_CONTEXT
            and PROMPT_LIBRARY.serves(q.device, q.dtype))


def prompt_attention(q, k, v, kv, block_table, context_lens, query_start, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] (the batch's new tokens, packed by request), kv the model's
    pool view, block_table int64 [B, max_blocks] of this layer, context_lens int64 [B] (including
    the new tokens), query_start int64 [B + 1] (request i owns packed tokens [i]:[i + 1]). Writes
    k/v into the pool; each new token attends its request's context up to its own position;
    returns [T, Hq * D]."""
    return _run(PROMPT_LIBRARY.lib.pf_paged_prompt_attention, PROMPT_LIBRARY.what, q, k, v, kv, block_table,
                context_lens, scale, query_start=query_start)
