"""paraflex/cpu_info.py: the machine line every benchmark prints, read from /proc/cpuinfo."""

import os

from paraflex import cpu_info


def test_first_processor_block_only(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU A\nflags\t\t: fpu avx2 fma avx512f amx_tile\n\n"
                    "processor\t: 1\nmodel name\t: Other CPU\nflags\t\t: fpu sse2\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda p, *a, **k: real_open(info if p == "/proc/cpuinfo" else p, *a, **k))
    assert cpu_info.cpu_model() == "Test CPU A"
    assert cpu_info.cpu_flags() == {"fpu", "avx2", "fma", "avx512f", "amx_tile"}
    line = cpu_info.machine_line()
    assert line.startswith(f"Test CPU A, {os.cpu_count()} CPUs, flags avx2,fma,avx512f,amx_tile, Python ")
    assert "load average" in line


def test_no_cpuinfo_gives_empty_flags(monkeypatch):
    def missing(*_a, **_k):
        raise FileNotFoundError("/proc/cpuinfo")

    monkeypatch.setattr("builtins.open", missing)
    assert cpu_info.cpu_flags() == set()
    assert cpu_info.cpu_model()  # falls back to what `platform` knows
    assert ", flags -, " in cpu_info.machine_line()
