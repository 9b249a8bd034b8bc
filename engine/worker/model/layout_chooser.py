"""Measure once, cache on disk, and report the layout each CPU projection shape uses.

Place in the data flow: `Linear` (engine/worker/model/linear.py) asks `CHOOSER.choose` when a
weight has more than one candidate layout (CPU: the compiled panels, oneDNN's packed layout,
plain `torch.mm`). The first time a process meets a shape (out x in, dtype, whether it sees
prefill-sized batches), the verdict comes from the disk cache or is measured here: every
candidate packed into enough copies of the weight to overflow the caches (as the weights of a
step's 30 layers do), timed at the decode and prefill row counts of layout_choice.py in
interleaved rounds (each round's fastest pass, the median over rounds:
paraflex/costs/robust_timing.py), then decided by `layout_choice.choose_layout` (pure). The
cache file, under native_build.cache_dir()/linear_layouts/, is keyed by the CPU's flags, the
torch version, the compiled kernel's digest and the thread count, so a change to any of them
measures again. `enabled` says when it measures: by default only among OpenMP layouts (not where
the compiled panels are a candidate, see there); `PARAFLEX_LINEAR_CHOOSER=0` / `1` forces it off /
on. Off, the first candidate (the compiled panels where they build) is taken.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from typing import Callable

import torch

from paraflex.costs.robust_timing import robust_time, spread
from paraflex.engine.kernels.native_build import cache_dir
from paraflex.cpu_info import cpu_flags
from paraflex.engine.worker.model.layout_choice import DECODE_ROWS, PREFILL_ROWS, Verdict, choose_layout

log = logging.getLogger(__name__)
SWITCH = "PARAFLEX_LINEAR_CHOOSER"
COLD_BYTES = 32 << 20  # copies of a weight per layout: past the per-core caches, as a step's layers are
MAX_COPIES = 16
COLD_ROWS = 32  # up to this many rows a pass runs over every copy (memory-bound); r rows over 32/r of them
ROUNDS, PASSES = 3, 2  # rounds (median of their minima) of passes over all copies
NOISY_SPREAD = 0.5  # rounds disagreeing this much (a busy machine): the verdict serves this process only

Build = Callable[[str, torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def enabled(layouts: list[str]) -> bool:
    """Whether to measure among `layouts`. `PARAFLEX_LINEAR_CHOOSER=1` / `0` forces it on / off.
    Unset, it is off where the compiled panels are a candidate: a shape is timed alone, but in a
    step a stage that mixes the panels (the kernels' own thread pool) with oneDNN or `torch.mm`
    (OpenMP's) switches pools between projections, and SmolLM2's chosen mix measured 1.3-1.45x
    slower projections than the panels alone at batch 1-8 (bench/cpu_decode_step.py, 2-vCPU
    AVX-512 Xeon, load 2); among OpenMP layouts alone (bf16: oneDNN vs `torch.mm`) it is on."""
    forced = os.environ.get(SWITCH)
    if forced is not None:
        return forced != "0"
    return "panels" not in layouts


def worth_caching(noise: float) -> bool:
    """Whether a verdict may stand for this machine: the rounds agreed and the machine was not
    oversubscribed (a load average at or over the CPU count slows OpenMP's barriers many times
    more than the kernels' own pool, which would crown the wrong layout for a quiet machine)."""
    return noise <= NOISY_SPREAD and os.getloadavg()[0] < (os.cpu_count() or 1)


def machine_key(kernel_path: str | None) -> str:
    """What a verdict depends on besides the shape: CPU flags, torch, the compiled kernel, threads."""
    text = " ".join([*sorted(cpu_flags()), torch.__version__, os.path.basename(kernel_path or "no-kernel"),
                     f"threads={torch.get_num_threads()}"])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def measure(layouts: list[str], build: Build, weight: torch.Tensor,
            rows: tuple[int, ...]) -> tuple[dict[str, dict[int, float]], float]:
    """(layout -> rows -> seconds per call, the largest spread of the rounds), each layout over
    its own cold copies of `weight` (prefill-sized rows are compute-bound: fewer copies, so the
    measuring stays short)."""
    nbytes = weight.numel() * weight.element_size()
    copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // nbytes)))
    used = {r: max(1, copies * COLD_ROWS // max(r, COLD_ROWS)) for r in rows}
    packed = {name: [build(name, weight) for _ in range(copies)] for name in layouts}
    inputs = {r: torch.randn(r, weight.shape[1]).to(weight.dtype) for r in rows}
    samples = {name: {r: [] for r in rows} for name in layouts}
    with torch.inference_mode():
        for name in layouts:  # warm-up: first calls allocate and load
            for r in rows:
                packed[name][0](inputs[r])
        for _ in range(ROUNDS):
            for r in rows:
                for name in layouts:  # interleaved: a busy stretch hits every layout alike
                    best = float("inf")
                    for _ in range(PASSES):
                        t0 = time.perf_counter()
                        for fn in packed[name][: used[r]]:
                            fn(inputs[r])
                        best = min(best, (time.perf_counter() - t0) / used[r])
                    samples[name][r].append([best])
    times = {name: {r: robust_time(s) for r, s in by_rows.items()} for name, by_rows in samples.items()}
    return times, max(spread(s) for by_rows in samples.values() for s in by_rows.values())


class LayoutChooser:
    """Verdicts per shape: in memory for this process, on disk for the machine."""

    def __init__(self) -> None:
        self.verdicts: dict[str, Verdict] = {}

    def path(self, kernel_path: str | None) -> str:
        return os.path.join(cache_dir(), "linear_layouts", f"{machine_key(kernel_path)}.json")

    def choose(self, layouts: list[str], build: Build, weight: torch.Tensor, prefill: bool,
               kernel_path: str | None) -> Verdict:
        """The layout of `weight` among `layouts` (in order of preference). `prefill`: whether
        prefill-sized batches reach it (the LM head sees one row per request only)."""
        n, k = weight.shape
        key = f"{n}x{k} {str(weight.dtype).split('.')[-1]} {'+'.join(layouts)} {'prefill' if prefill else 'decode'}"
        path = self.path(kernel_path)
        if key in self.verdicts:
            return self.verdicts[key]
        stored = read_cache(path).get(key)
        if stored is not None:
            verdict = Verdict(stored["layout"], stored["scores"], stored["split"])
            how = "cached"
        else:
            t0 = time.perf_counter()
            prefill_rows = PREFILL_ROWS if prefill else ()
            times, noise = measure(layouts, build, weight, DECODE_ROWS + prefill_rows)
            verdict = choose_layout(times, DECODE_ROWS, prefill_rows)
            how = f"measured in {time.perf_counter() - t0:.1f} s, rounds {noise:.0%} apart, load {os.getloadavg()[0]:.1f}"
            if worth_caching(noise):
                write_cache(path, key, {"layout": verdict.layout, "scores": verdict.scores, "split": verdict.split,
                                        "how": how, "times": {name: {str(r): t for r, t in by_rows.items()}
                                                              for name, by_rows in times.items()}})
            else:
                how += "; busy machine, not cached: measured again at the next start"
        log.info("projection %s: %s (%s)", key, verdict.describe(), how)
        self.verdicts[key] = verdict
        return verdict


def read_cache(path: str) -> dict:
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def write_cache(path: str, key: str, entry: dict) -> None:
    """Add one verdict (read, merge, replace atomically: engines starting at once keep a whole file)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = read_cache(path)
        data[key] = entry
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False, suffix=".tmp") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
        os.replace(fh.name, path)
    except OSError as exc:  # an unwritable cache measures again next time; nothing else changes
        log.warning("projection layouts not cached (%s)", exc)


CHOOSER = LayoutChooser()
