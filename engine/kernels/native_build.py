"""Build and load the engine's compiled CPU kernels (the C files of paraflex.csrc).

Place in the data flow: `native_attention`, `native_ops` and `model/linear` each own one
`NativeLibrary`, all depending on `THREAD_POOL` (defined here); the first call that needs a
kernel loads it: the C file and the headers beside it are compiled once per machine with the
system C compiler into a cache directory ($PARAFLEX_CACHE_DIR, default ~/.cache/paraflex, or a
per-user temp folder when home is not writable), keyed by the sources and the compiler flags (by
the CPU's vector capability), then loaded with ctypes. No compiler or a failed build leaves the
torch path in place with one warning; a library's switch variable set to 0 (or the pool's,
PARAFLEX_NATIVE_POOL=0, for all of them) does so silently.
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
from typing import Callable

import torch

from paraflex.cpu_info import FLAGS_OF_INTEREST, cpu_flags

log = logging.getLogger(__name__)
# Not -ffast-math: a shared object built with it switches the loading process to flush-to-zero.
BASE_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
              "-fno-signed-zeros", "-fassociative-math"]
CAPABILITY_FLAGS = {"AVX2": ["-mavx2", "-mfma"], "AVX512": ["-mavx512f", "-mavx512vl", "-mfma"]}


def cache_dir() -> str:
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


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (avx512_bf16 or AMX, as oneDNN sees it)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def capability_line() -> str:
    """What the kernels run with here, for a benchmark's report: CPU count, the vector flags
    that matter, torch's capability and whether oneDNN multiplies bfloat16 natively."""
    flags = cpu_flags()
    return (f"cpus={os.cpu_count()} flags={','.join(f for f in FLAGS_OF_INTEREST if f in flags) or '-'} "
            f"capability={torch.backends.cpu.get_cpu_capability()} onednn_bf16={'native' if native_bf16() else 'no'}")


def capability_flags() -> list[str]:
    """The vector flags the kernels are built with here: those of torch's capability, plus
    -mavx512bf16 where an AVX-512 CPU has avx512_bf16 (the bfloat16 attention's VDPBF16PS)."""
    flags = list(CAPABILITY_FLAGS.get(torch.backends.cpu.get_cpu_capability(), []))
    if "-mavx512f" in flags and "avx512_bf16" in cpu_flags():
        flags.append("-mavx512bf16")
    return flags


def compiler() -> str | None:
    """The C compiler the kernels are built with: $CC, else cc or gcc on PATH (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(source: str, extra_flags: list[str]) -> str:
    """Path of the shared library for csrc/`source`, compiled if not cached for these sources,
    flags and CPU capability."""
    package = resources.files("paraflex.csrc")
    files = {source: package.joinpath(source).read_bytes()}
    files.update({f.name: f.read_bytes() for f in package.iterdir() if f.name.endswith(".h")})
    flags = [*BASE_FLAGS, *extra_flags, *capability_flags()]
    digest = hashlib.sha256(" ".join(flags).encode())
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name])
    stem = source.rsplit(".", 1)[0]
    target = os.path.join(cache_dir(), "native", f"{stem}-{digest.hexdigest()[:16]}.so")
    if os.path.exists(target):
        return target
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "wb") as fh:
                fh.write(text)
        out = os.path.join(tmp, "lib.so")
        cmd = [cc, *flags, os.path.join(tmp, source), "-o", out, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, target)  # atomic: engines building at once all end with one whole file
    return target


class NativeLibrary:
    """One C file of paraflex.csrc, compiled and loaded on first use (or None, logged once).

    `switch`: environment variable that turns it off when set to 0. `declare(lib)` sets the
    functions' ctypes signatures. `depends`: libraries loaded first with their symbols global
    (the kernels call the thread pool's `pf_pool_run`); `global_symbols`: load this one so.
    `hold_gil`: load with ctypes.PyDLL (the GIL stays held during calls: right for calls of
    microseconds, where releasing and taking it back costs more and can hand the interpreter to
    another thread); else ctypes.CDLL (released: long kernels). `dtypes`: the tensor dtypes its
    kernels take."""

    def __init__(self, source: str, switch: str, what: str, declare: Callable[[ctypes.CDLL], None], *,
                 extra_flags: tuple[str, ...] = (), depends: tuple["NativeLibrary", ...] = (),
                 global_symbols: bool = False, hold_gil: bool = False,
                 dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        self.source, self.switch, self.what, self.dtypes = source, switch, what, dtypes
        self.declare, self.extra_flags, self.hold_gil = declare, list(extra_flags), hold_gil
        self.depends, self.global_symbols = depends, global_symbols
        self.lib: ctypes.CDLL | None = None
        self.path: str | None = None  # the loaded shared object (its name holds the sources' digest)
        self.tried = False

    def load(self) -> ctypes.CDLL | None:
        if self.tried:
            return self.lib
        self.tried = True
        if os.environ.get(self.switch, "1") == "0":
            return None
        missing = [dep.what for dep in self.depends if dep.load() is None]
        if missing:  # the dependency said why, once
            log.debug("%s unavailable (needs the %s); using the torch path", self.what, ", ".join(missing))
            return None
        try:
            path = build(self.source, self.extra_flags)
            mode = ctypes.RTLD_GLOBAL if self.global_symbols else ctypes.DEFAULT_MODE
            lib = ctypes.PyDLL(path, mode=mode) if self.hold_gil else ctypes.CDLL(path, mode=mode)
        except (OSError, RuntimeError) as exc:
            log.warning("%s unavailable (%s); using the torch path", self.what, exc)
            return None
        self.declare(lib)
        self.lib, self.path = lib, path
        return lib

    def serves(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this library runs tensors of `device` and `dtype`: CPU tensors of one of its
        `dtypes`, and only once the library has loaded."""
        return device.type == "cpu" and dtype in self.dtypes and self.load() is not None

    def forget(self) -> None:
        """Load again on the next call (tests of the build rules)."""
        self.lib, self.path, self.tried = None, None, False


def _no_functions(lib: ctypes.CDLL) -> None:
    """The pool is called from C only."""


# One pool of worker threads per process for every kernel (csrc/thread_pool.c).
THREAD_POOL = NativeLibrary("thread_pool.c", "PARAFLEX_NATIVE_POOL", "compiled CPU thread pool", _no_functions,
                            extra_flags=("-pthread",), global_symbols=True)
