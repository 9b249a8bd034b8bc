"""The compiled CPU decode-attention kernel (csrc/paged_decode_attention.c): build, load, call.

Place in the data flow: `paged_attention` (engine/attention.py) calls `decode_attention` for a
float32 decode batch on CPU; the kernel stores the new keys/values in the pool and attends over
each request's context where its blocks lie, instead of copying the whole context of the batch
into one tensor per layer (the torch path's cost on CPU). The C file is compiled once per machine
with the system C compiler into a cache directory ($PARAFLEX_CACHE_DIR, default
~/.cache/paraflex, or a per-user temp folder when home is not writable) keyed by the source and
the compiler flags (by the CPU's vector capability), then loaded with ctypes (which releases
the GIL during the call). No compiler, a failed build, or PARAFLEX_NATIVE_ATTENTION=0 leaves
the torch path in place (one log line says why).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from importlib import resources

import torch

log = logging.getLogger(__name__)
SOURCE = "paged_decode_attention.c"
# Not -ffast-math: a shared object built with it switches the loading process to flush-to-zero.
_BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-fno-trapping-math",
               "-fno-signed-zeros", "-fassociative-math", "-ffp-contract=fast"]
_FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512vl", "-mfma"]}
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> str:
    """$PARAFLEX_CACHE_DIR, else ~/.cache/paraflex, else (home not writable) a per-user temp folder."""
    chosen = os.environ.get("PARAFLEX_CACHE_DIR")
    if chosen:
        return chosen
    home = os.path.join(os.path.expanduser("~"), ".cache", "paraflex")
    try:
        os.makedirs(home, exist_ok=True)
        writable = os.access(home, os.W_OK)
    except OSError:
        writable = False
    return home if writable else os.path.join(tempfile.gettempdir(), f"paraflex-cache-{os.getuid()}")


def _build(source: bytes, capability: str) -> str:
    """Path of the shared library for this source and CPU capability, compiled if not cached."""
    flags = [*_BASE_FLAGS, *_FLAGS.get(capability, [])]
    key = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = os.path.join(_cache_dir(), "native", f"paged_decode_attention-{key}.so")
    if os.path.exists(target):
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        src = os.path.join(tmp, SOURCE)
        with open(src, "wb") as fh:
            fh.write(source)
        out = os.path.join(tmp, "lib.so")
        cmd = [compiler, *flags, src, "-o", out]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: engines building at once all end with one whole file
    return target


def load() -> ctypes.CDLL | None:
    """The loaded kernel, or None when it is off or cannot be built here (logged once)."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PARAFLEX_NATIVE_ATTENTION", "1") == "0":
        return None
    try:
        source = resources.files("paraflex.csrc").joinpath(SOURCE).read_bytes()
        capability = torch.backends.cpu.get_cpu_capability()
        lib = ctypes.CDLL(_build(source, capability))
    except (OSError, RuntimeError) as exc:
        log.warning("compiled CPU attention unavailable (%s); using the torch path", exc)
        return None
    fn = lib.pf_paged_decode_attention
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [ptr, ptr, ptr, ptr, i64, i64, i32, i32, i32, i32, ptr, i64, ptr, i64, ctypes.c_float, ptr, i32]
    fn.restype = ctypes.c_int
    _lib = lib
    return lib


def usable(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether this decode batch can take the kernel: float32 on CPU, head_dim a multiple of the
    kernel's vector width (8), kernel loaded."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and kv.dtype == torch.float32
            and q.shape[-1] % 8 == 0 and load() is not None)


# Context tokens (summed over the batch) per kernel thread: below this a second thread costs more
# than it saves. SmolLM2, 30 layers, 2-core VM: batch 8 x 192 tokens took 10.7 ms on one thread
# and 17.4 ms on two (thread start-up, and torch's OpenMP workers still spinning on the other
# core after the previous op); batch 32 x 192 took 49.6 ms on one and 42.2 ms on two.
TOKENS_PER_THREAD = 4096


def decode_attention(q, k, v, kv, block_table, context_lens, scale: float, total_context: int) -> torch.Tensor:
    """q [B, Hq, D], k/v [B, Hkv, D] (one new token per request), kv the model's pool view
    [blocks, 2, tpb, Hkv, D], block_table int64 [B, max_blocks] of this layer, context_lens int64
    [B] (including the new token), total_context their sum. Writes k/v into the pool; returns
    [B, Hq * D]."""
    b, num_heads, head_dim = q.shape
    kv_heads, tpb = k.shape[1], kv.shape[2]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(b, num_heads * head_dim, dtype=q.dtype)
    rc = _lib.pf_paged_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), kv.data_ptr(), kv.stride(0), kv.stride(1), tpb,
        kv_heads, num_heads // kv_heads, head_dim, block_table.data_ptr(), block_table.shape[1],
        context_lens.data_ptr(), b, scale, out.data_ptr(),
        max(1, min(torch.get_num_threads(), total_context // TOKENS_PER_THREAD)),
    )
    if rc != 0:
        raise MemoryError("compiled CPU attention: no memory for its score buffer")
    return out
