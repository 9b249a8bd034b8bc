"""engine/kernels/malloc_policy.py: a CPU engine's process reuses large activations from the heap."""

import subprocess
import sys

SCRIPT = """
import ctypes, resource, sys
from paraflex.engine.kernels import malloc_policy
print(malloc_policy.apply())
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 16 << 20  # a prefill activation's size: above glibc's default mmap threshold
def touch_once():  # two activations of one step, freed after it
    blocks = [libc.malloc(size) for _ in range(2)]
    for p in blocks:
        ctypes.memset(p, 1, size)
    for p in reversed(blocks):
        libc.free(p)
touch_once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    touch_once()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run(switch: str) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={"PARAFLEX_MALLOC_TUNING": switch, "PATH": ""},
                         capture_output=True, text=True, check=True).stdout.split()
    return out[0], int(out[1])


def test_tuned_process_reuses_freed_large_blocks_without_page_faults():
    applied, faults = run("1")
    if applied != "True":
        import pytest
        pytest.skip("not glibc: nothing to tune")
    assert faults < 100  # the freed 16 MiB blocks came back from the heap, already mapped


def test_switch_off_keeps_glibc_defaults():
    applied, faults = run("0")
    assert applied == "False"
    assert faults > 5 * (16 << 20) // 4096  # glibc trims the freed top of the heap: faulted in again
